"""What the pipeline and the prediction service share, with no torch and no Airflow.

The preprocessing spec, the typed contracts between stages (model.json, the registry entry,
billing.json, ...), the registry layout and the storage URI helpers. The service imports this
package and nothing else of burstcv; the training box installs the parts training needs.
"""
