# burstcv's Airflow image: every Airflow component of docker-compose.yaml runs from it
# (api-server, scheduler, dag-processor, triggerer, Celery worker, init).
# Build from the repository root:  docker build -f docker/airflow.Dockerfile -t burstcv-airflow .
#
# It installs the project's lock (requirements.txt, the environment the tests ran in) and the
# burstcv package, rather than starting from apache/airflow, so the image runs exactly the
# tested versions. DAGs, plugins and var/ are mounted by compose, not baked in.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    AIRFLOW_HOME=/opt/burstcv/var/airflow

# libgomp1: torch's CPU kernels (training on the local backend); tini: PID 1 that forwards
# signals so `docker compose stop` lets the scheduler and worker finish cleanly.
RUN apt-get update \
    && apt-get install -y --no-install-recommends libgomp1 tini \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/burstcv
COPY requirements.txt /opt/burstcv/requirements.txt
RUN pip install --no-compile -r requirements.txt

COPY pyproject.toml README.md /opt/burstcv/
COPY src /opt/burstcv/src
COPY serving/burstcv_serving /opt/burstcv/serving/burstcv_serving
RUN pip install --no-compile --no-deps /opt/burstcv

# Non-root, uid 50000 as in Airflow's official image; group 0 so an arbitrary uid (AIRFLOW_UID)
# can still write the mounted var/.
RUN useradd --uid 50000 --gid 0 --home-dir /opt/burstcv --no-create-home airflow \
    && mkdir -p /opt/burstcv/var /opt/burstcv/dags /opt/burstcv/plugins \
    && chown -R 50000:0 /opt/burstcv && chmod -R g+rwX /opt/burstcv
USER 50000

ENTRYPOINT ["/usr/bin/tini", "--", "airflow"]
CMD ["version"]
