# burstcv's Airflow images: Airflow's official image plus the burstcv wheel, its DAGs and its
# plugin, which is also how burstcv goes into an Airflow someone already runs (docs/airflow.md).
#
#   docker build -f docker/airflow.Dockerfile --target airflow -t burstcv-airflow .
#   docker build -f docker/airflow.Dockerfile --target worker -t burstcv-worker .
#
# Two targets from one build:
# - airflow: every component but the worker (api-server, scheduler, dag-processor, triggerer,
#   init). Runtime dependencies only (docker/requirements-runtime.txt, generated from the
#   development lock by docker/locks.py): no torch, no test tools.
# - worker: the Celery worker, which validates, trains on the local backend and exports ONNX.
#   It adds torch and torchvision (the `train` extra, docker/requirements-train.txt) from
#   TORCH_INDEX_URL: PyTorch's CPU index by default, since no container here has a GPU (GPU
#   training runs on EC2 boxes, which bring their own torch).
ARG AIRFLOW_IMAGE=apache/airflow:3.3.2-python3.11

# The wheel, built from the checkout (pyproject.toml lists src/, spec/ and serving/'s packages).
FROM ${AIRFLOW_IMAGE} AS wheel
COPY --chown=airflow:0 pyproject.toml README.md /tmp/burstcv/
COPY --chown=airflow:0 src /tmp/burstcv/src
COPY --chown=airflow:0 spec /tmp/burstcv/spec
COPY --chown=airflow:0 serving/burstcv_serving /tmp/burstcv/serving/burstcv_serving
RUN pip wheel --no-deps --no-cache-dir --wheel-dir /tmp/dist /tmp/burstcv

# What every component has: Airflow at the image's version, the runtime lock the tests ran with.
FROM ${AIRFLOW_IMAGE} AS runtime
ARG AIRFLOW_VERSION=3.3.2
# Packages a deployment adds, e.g. apache-airflow-providers-fab for its auth manager.
ARG EXTRA_PIP_PACKAGES=""
COPY docker/requirements-runtime.txt /tmp/requirements-runtime.txt
RUN pip install --no-cache-dir "apache-airflow==${AIRFLOW_VERSION}" \
      -r /tmp/requirements-runtime.txt ${EXTRA_PIP_PACKAGES}
# BURSTCV_HOME (src/burstcv/settings.py): artifact store, registry, local compute records; a
# volume shared by the worker, the triggerer, the api-server and the prediction service.
# PYTHONUSERBASE: packages installed as the airflow user stay importable by any uid
# (AIRFLOW_UID), also in processes that do not pass through the entrypoint (health checks,
# `exec`), which otherwise look for them under the uid's own home.
ENV BURSTCV_HOME=/opt/burstcv \
    PYTHONUSERBASE=/home/airflow/.local
# The mount points of the stack's volumes, writable by group 0 (any AIRFLOW_UID).
USER root
RUN mkdir -p /opt/burstcv /opt/airflow/auth \
    && chown 50000:0 /opt/burstcv /opt/airflow/auth \
    && chmod 2775 /opt/burstcv && chmod 2770 /opt/airflow/auth
USER airflow

FROM runtime AS airflow
COPY --from=wheel /tmp/dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/burstcv-*.whl
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
COPY --chown=airflow:0 plugins/ /opt/airflow/plugins/

# torch first, the project after: a change to the code leaves the torch layer cached.
FROM runtime AS worker
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
COPY docker/requirements-train.txt /tmp/requirements-train.txt
RUN PIP_EXTRA_INDEX_URL="${TORCH_INDEX_URL} ${PIP_EXTRA_INDEX_URL:-}" \
      pip install --no-cache-dir -r /tmp/requirements-train.txt -c /tmp/requirements-runtime.txt
COPY --from=wheel /tmp/dist/ /tmp/dist/
RUN pip install --no-cache-dir --no-deps /tmp/dist/burstcv-*.whl
COPY --chown=airflow:0 dags/ /opt/airflow/dags/
COPY --chown=airflow:0 plugins/ /opt/airflow/plugins/
