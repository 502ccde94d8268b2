"""Price any region and type from AWS, as the orchestrator does at validate, provision and teardown.

eu-west-1 and g5.2xlarge are in no row of the bundled table. On-demand prices come from the
AWS Price List API, which the emulator does not model: the recording proxy answers
``pricing:GetProducts`` as the API does, with the product its filters name in the API's
documented shape, or an empty list for a type it does not price (the call is still audited
against deploy/iam-policy.json); spot prices come from the emulator's
DescribeSpotPriceHistory for the AZ launched. Every quote is cached in the artifact store
with its date and source; the bundled table answers only when AWS cannot.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import replace
from typing import Any

import pytest
from awsaudit import EMPTY_PRICE_LIST, AwsCall, RecordingProxy, price_list
from burstcv_testkit import HELD_WHEEL, launch_of

from burstcv.compute.base import InstanceInfo
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.cost import budget
from burstcv.cost.quotes import (
    SOURCE_BUNDLED,
    SOURCE_PRICE_LIST,
    SOURCE_SPOT_HISTORY,
    PriceSources,
    aws_price_sources,
    quote,
    quote_uri,
)
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import data, resolve
from burstcv_spec import storage
from burstcv_spec.contracts import BoxRate, PriceQuote, RunRef, read_artifact

REGION = "eu-west-1"
TYPE = "g5.2xlarge"  # neither in the bundled table
ON_DEMAND_USD = "1.3180000000"
VOLUME_GB = 50  # the root volume of the emulator's deployment (conftest's ec2_settings)
WATCHDOG_MARGIN_S = (5 + 1) * 60  # a box outlives the deadline by the margin (5 min) + 1 min
IPV4_USD_PER_HOUR = 0.005  # AWS's public IPv4 price, every commercial region


def asked_for(proxy: RecordingProxy, instance_type: str) -> list[AwsCall]:
    """Return the GetProducts calls that asked for ``instance_type``."""
    return [
        c
        for c in proxy.snapshot()
        if c.action == "pricing:GetProducts"
        and {"Field": "instanceType", "Type": "TERM_MATCH", "Value": instance_type}
        in c.params["Filters"]
    ]


@pytest.fixture
def far_deployment(
    s3_deployment: Settings, monkeypatch: pytest.MonkeyPatch, audited_calls: RecordingProxy
) -> Settings:
    """Configure a deployment in eu-west-1 with the Price List API answering a recorded response."""
    monkeypatch.setenv("BURSTCV_EC2_REGION", REGION)
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", TYPE)
    audited_calls.answers["pricing:GetProducts"] = price_list({TYPE: ON_DEMAND_USD}, REGION)
    return s3_deployment


def params(**overrides: Any) -> RunParams:
    """Return an ec2 run on the far type with a $1 budget."""
    fields: dict[str, Any] = {
        "dataset_uri": "s3://unused/dataset",
        "compute_backend": "ec2",
        "instance_types": [TYPE],
        "max_cost_usd": 1.0,
        "time_budget_s": 3600,
    }
    return RunParams(**{**fields, **overrides})


def actions(proxy: RecordingProxy) -> list[str]:
    """Return the actions the orchestrator sent, in order."""
    return [c.action for c in proxy.snapshot()]


def test_a_region_and_type_outside_the_table_are_priced_from_aws_and_cached(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    costs = budget.resolve_costs(params(), far_deployment)
    # The cost model's rule, computed here: a box is its instance (quoted from AWS), its
    # 50 GB gp3 root volume (eu-west-1: $0.088 per GB-month of 730 hours) and its public
    # IPv4; $1 must pay for it until the deadline plus the watchdog's margin.
    box_usd_per_hour = 1.318 + VOLUME_GB * 0.088 / 730 + IPV4_USD_PER_HOUR
    expected_s = math.floor(1.0 / box_usd_per_hour * 3600) - WATCHDOG_MARGIN_S
    assert costs.time_budget_s == expected_s == 2348  # about 39 min, not the 45 of $1 at $1.318/h
    rate = costs.box_rate
    assert (rate.instance_type, rate.market, rate.volume_gb) == (TYPE, "on-demand", VOLUME_GB)
    assert rate.usd_per_hour == pytest.approx(1.318)
    assert (rate.ebs_usd_per_gb_month, rate.public_ipv4_usd_per_hour) == (0.088, 0.005)
    assert (costs.boxes, costs.margin_s, costs.region) == (1, WATCHDOG_MARGIN_S, REGION)
    (call,) = asked_for(audited_calls, TYPE)
    assert call.region == "us-east-1"  # the Price List API's endpoint, for every region
    assert {"Field": "regionCode", "Type": "TERM_MATCH", "Value": REGION} in call.params["Filters"]
    cached = read_artifact(
        quote_uri(far_deployment.artifact_root, TYPE, REGION, "on-demand", ""), PriceQuote
    )
    assert cached.usd_per_hour == pytest.approx(1.318)
    assert cached.source == SOURCE_PRICE_LIST and cached.fetched_at and cached.as_of
    # Nobody prices the serving fleet's CPU types in eu-west-1: the run says what to set.
    assert costs.serving == [] and costs.serving_unpriced is not None
    assert "c7i.large" in costs.serving_unpriced and "BURSTCV_PRICE_TABLE" in costs.serving_unpriced

    audited_calls.clear()
    assert budget.resolve_costs(params(), far_deployment).time_budget_s == expected_s
    assert asked_for(audited_calls, TYPE) == []  # fresh in the store: not asked


def test_an_account_denied_the_price_lists_first_endpoint_is_priced_at_its_second(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    # An organisation that denies every region but its own (a service control policy) refuses
    # the Price List API in us-east-1; it allows ap-south-1, the API's other endpoint.
    scp = json.dumps(
        {
            "__type": "AccessDeniedException",
            "Message": "User is not authorized to perform: pricing:GetProducts with an explicit "
            "deny in a service control policy",
        }
    ).encode()
    answer = price_list({TYPE: ON_DEMAND_USD}, REGION)
    audited_calls.answers["pricing:GetProducts"] = lambda call: (
        (400, scp) if call.region == "us-east-1" else answer(call)
    )
    backend = Ec2Backend(Ec2Settings())
    sources = backend.price_sources(far_deployment.artifact_root)

    found = budget.candidate_quotes([TYPE], REGION, sources)[TYPE]
    assert found is not None and found.source == SOURCE_PRICE_LIST
    assert found.usd_per_hour == pytest.approx(1.318)
    assert [c.region for c in asked_for(audited_calls, TYPE)] == ["us-east-1", "ap-south-1"]
    # The endpoint that answered is asked first from then on.
    audited_calls.clear()
    budget.candidate_quotes(["g6.xlarge"], REGION, sources)
    assert [c.region for c in asked_for(audited_calls, "g6.xlarge")] == ["ap-south-1"]


def test_a_spot_box_is_billed_at_its_own_azs_spot_price(
    far_deployment: Settings, player: Any, kit: Any, audited_calls: RecordingProxy
) -> None:
    player.modes["far-spot"] = kit.HOLD
    backend = Ec2Backend(Ec2Settings())
    (iid,) = backend.launch(
        launch_of("far-spot", "s3://never-read/job.json", dag_id="dag", **HELD_WHEEL)
    )
    (info,) = backend.describe("far-spot")
    assert info.lifecycle == "spot" and info.zone.startswith(REGION)

    rate = backend.box_rate(info, bound=None)  # what its launch record bills it at
    assert backend.terminate_run("far-spot") == [iid]

    spot = read_artifact(
        quote_uri(far_deployment.artifact_root, TYPE, REGION, "spot", info.zone), PriceQuote
    )
    assert spot.source == SOURCE_SPOT_HISTORY and spot.zone == info.zone
    assert rate.usd_per_hour == spot.usd_per_hour and rate.market == "spot"
    assert SOURCE_SPOT_HISTORY in rate.price_source
    # Its root volume at eu-west-1's gp3 price, and its public IPv4 (the default subnet
    # gives it one), are billed with it.
    assert (rate.volume_gb, rate.ebs_usd_per_gb_month) == (VOLUME_GB, 0.088)
    assert info.public_ipv4 and rate.public_ipv4_usd_per_hour == IPV4_USD_PER_HOUR
    history = [c for c in audited_calls.snapshot() if c.action == "ec2:DescribeSpotPriceHistory"]
    assert history and history[0].region == REGION


def test_without_aws_the_bundled_table_answers_and_says_so(
    s3_deployment: Settings, audited_calls: RecordingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = json.dumps({"__type": "AccessDeniedException", "Message": "no"}).encode()
    audited_calls.answers["pricing:GetProducts"] = (400, denied)
    monkeypatch.setenv("BURSTCV_EC2_REGION", "us-east-1")

    sources = budget.price_sources(params(), s3_deployment)
    quotes = budget.candidate_quotes(["g6.xlarge"], "us-east-1", sources)

    (found,) = quotes.values()
    assert found is not None and (found.instance_type, found.usd_per_hour) == ("g6.xlarge", 0.8048)
    assert found.source == SOURCE_BUNDLED and found.as_of == "2024-06-01"
    cached_uri = quote_uri(s3_deployment.artifact_root, "g6.xlarge", "us-east-1", "on-demand", "")
    assert not storage.exists(cached_uri)  # a fallback is not cached as if AWS had said it


def test_a_type_nobody_prices_counts_at_the_highest_known_price(
    far_deployment: Settings, audited_calls: RecordingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    audited_calls.answers["pricing:GetProducts"] = (200, EMPTY_PRICE_LIST)
    monkeypatch.setenv("BURSTCV_EC2_REGION", "us-east-1")
    # g5.2xlarge has no price anywhere; g6.xlarge is in the bundled table for us-east-1.
    run = params(instance_types=[TYPE, "g6.xlarge"], max_cost_usd=0.8048)
    costs = budget.resolve_costs(run, far_deployment)
    assert (costs.box_rate.instance_type, costs.box_rate.usd_per_hour) == ("g6.xlarge", 0.8048)
    # The budget prices every box at g6.xlarge's rate: its instance, 50 GB of gp3 in
    # us-east-1 ($0.08 per GB-month) and a public IPv4, until the deadline plus the margin.
    box_usd_per_hour = 0.8048 + VOLUME_GB * 0.08 / 730 + IPV4_USD_PER_HOUR
    expected_s = math.floor(0.8048 / box_usd_per_hour * 3600) - WATCHDOG_MARGIN_S
    assert costs.time_budget_s == expected_s == 3193


def test_a_run_nobody_can_price_fails_at_validate_with_one_line(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    audited_calls.answers["pricing:GetProducts"] = (
        400,
        json.dumps({"__type": "AccessDeniedException", "Message": "not allowed"}).encode(),
    )
    with pytest.raises(resolve.ValidationFailed) as failed:
        data.validate(RunRef.of("manual__unpriced"), far_deployment, params=params())
    line = str(failed.value)
    assert "\n" not in line and TYPE in line and REGION in line
    assert "pricing:GetProducts" in line and "BURSTCV_PRICE_TABLE" in line
    assert not [c for c in audited_calls.snapshot() if c.action.startswith("ec2:Run")]


@pytest.mark.parametrize("made_by", ["backend", "deployment"])
def test_a_type_the_bundled_table_prices_too_is_priced_from_aws_in_both_markets(
    made_by: str, s3_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    """The EC2 backend's sources (its bills) and the deployment's (the budget) both ask AWS:
    on-demand at the Price List API, spot at the region's spot price history; the bundled
    table's older figure for the same type answers only where no AWS source is given."""
    region = s3_deployment.ec2.region
    assert region == "us-east-1"  # g6.xlarge has a row here: $0.8048 on-demand
    audited_calls.answers["pricing:GetProducts"] = price_list({"g6.xlarge": "0.9100000000"}, region)
    if made_by == "backend":
        backend = Ec2Backend(Ec2Settings())
        sources = backend.price_sources()  # the store: the deployment's
        assert sources.ec2 is not None and sources.ec2() is backend.client
    else:
        sources = aws_price_sources(s3_deployment.ec2, s3_deployment.artifact_root)
        assert sources.ec2 is not None and sources.ec2() is sources.ec2()  # one client, reused
    assert sources.artifact_root == s3_deployment.artifact_root

    on_demand = quote("g6.xlarge", region, "on-demand", sources)
    assert on_demand is not None and on_demand.source == SOURCE_PRICE_LIST
    assert on_demand.usd_per_hour == pytest.approx(0.91)
    zone = f"{region}a"
    spot = quote("g6.xlarge", region, "spot", sources, zone=zone)
    assert spot is not None and spot.source == SOURCE_SPOT_HISTORY and spot.zone == zone
    priced_by = {"pricing:GetProducts", "ec2:DescribeSpotPriceHistory"}
    asked = [(c.action, c.region) for c in audited_calls.snapshot() if c.action in priced_by]
    assert asked == [
        ("pricing:GetProducts", "us-east-1"),
        ("ec2:DescribeSpotPriceHistory", region),
    ]
    # Both are cached in the deployment's store, as AWS said them.
    cached = read_artifact(
        quote_uri(s3_deployment.artifact_root, "g6.xlarge", region, "on-demand", ""), PriceQuote
    )
    assert (cached.source, cached.usd_per_hour) == (SOURCE_PRICE_LIST, on_demand.usd_per_hour)
    assert storage.exists(quote_uri(s3_deployment.artifact_root, "g6.xlarge", region, "spot", zone))
    # Without an AWS source, a store that has no quote yet gets the table's figure.
    offline = PriceSources(artifact_root=storage.join(s3_deployment.artifact_root, "offline"))
    table = quote("g6.xlarge", region, "on-demand", offline)
    assert table is not None and (table.source, table.usd_per_hour) == (SOURCE_BUNDLED, 0.8048)


def test_the_deployments_spot_prices_are_asked_of_its_own_region(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    """The Price List API answers from us-east-1 for every region; spot prices are per region:
    the deployment's EC2 client is its own region's."""
    sources = aws_price_sources(Ec2Settings(), far_deployment.artifact_root)
    spot = quote(TYPE, REGION, "spot", sources, zone=f"{REGION}a")
    assert spot is not None and spot.source == SOURCE_SPOT_HISTORY
    history = [c for c in audited_calls.snapshot() if c.action == "ec2:DescribeSpotPriceHistory"]
    assert [c.region for c in history] == [REGION]


def test_a_box_nobody_can_quote_is_billed_at_the_runs_bound_rate(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    audited_calls.answers["pricing:GetProducts"] = (200, EMPTY_PRICE_LIST)
    backend = Ec2Backend(Ec2Settings())
    # Not priced by the Price List API in eu-west-1, nor by the bundled table; no address.
    info = InstanceInfo(
        instance_id="i-0unpriced",
        run_id="unpriced",
        dag_id="dag",
        state="running",
        instance_type=TYPE,
        lifecycle="on-demand",
        zone=f"{REGION}a",
        public_ipv4=False,
    )
    bound = BoxRate(
        instance_type="g6.xlarge", market="on-demand", usd_per_hour=2.5, price_source="a bound"
    )

    rate = backend.box_rate(info, bound=bound)
    assert (rate.instance_type, rate.market, rate.usd_per_hour) == (TYPE, "on-demand", 2.5)
    assert rate.price_source.startswith("no quote: the run's bound rate")
    assert rate.public_ipv4_usd_per_hour == 0.0  # a box without a public IPv4 pays for none
    assert (rate.volume_gb, rate.ebs_usd_per_gb_month) == (VOLUME_GB, 0.088)
    # With no bound either, the box's instance is billed nothing rather than a guess.
    unbound = backend.box_rate(replace(info, public_ipv4=True), bound=None)
    assert unbound.usd_per_hour == 0.0 and unbound.price_source == rate.price_source
    assert unbound.public_ipv4_usd_per_hour == IPV4_USD_PER_HOUR
    assert [c.region for c in asked_for(audited_calls, TYPE)] == ["us-east-1", "us-east-1"]


@pytest.mark.parametrize(
    ("run_on", "deployment_reaches_aws", "asks_aws"),
    [("ec2", True, True), ("ec2", False, True), ("local", True, True), ("local", False, False)],
)
def test_a_run_is_priced_by_aws_unless_it_runs_locally_on_a_deployment_without_aws(
    run_on: str,
    deployment_reaches_aws: bool,
    asks_aws: bool,
    tmp_path: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An EC2 run must reach AWS anyway, and a deployment that reaches it asks it; only a local
    run on a deployment with no AWS at all is priced from the store and the bundled table (it
    never waits on a network it does not have)."""
    for key in list(os.environ):
        if key.startswith(("AWS_", "AIRFLOW_CONN_AWS", "BURSTCV_EC2_")):
            monkeypatch.delenv(key)
    if deployment_reaches_aws:
        monkeypatch.setenv("AWS_PROFILE", "ml-team")
    settings = Settings(artifact_root=str(tmp_path / "artifacts"), compute_backend="local")
    assert settings.aws_configured() is deployment_reaches_aws

    sources = budget.price_sources(params(compute_backend=run_on), settings)

    assert sources.artifact_root == settings.artifact_root
    assert (sources.pricing is not None, sources.ec2 is not None) == (asks_aws, asks_aws)
    if not asks_aws:
        found = quote("g6.xlarge", "us-east-1", "on-demand", sources)
        assert found is not None and (found.source, found.usd_per_hour) == (SOURCE_BUNDLED, 0.8048)
