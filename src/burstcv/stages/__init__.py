"""The pipeline's stages, one module each: what the DAG's tasks and the CLI's verbs call.

A run is resolved once by its first stage (``resolve``: run.json); every later stage takes the
run (``RunRef``) and the few values it uses, reads its inputs through the run's layout, and
returns a typed result of references and figures (``burstcv_spec.contracts``), which is all
that travels through XCom. Nothing here imports Airflow. In run order: ``resolve``, ``data``,
``boxes``, ``export``, ``benchmark`` (with ``sizing``), ``gate``, ``deploy``, ``report``.
"""
