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
from typing import Any

import pytest
from awsaudit import EMPTY_PRICE_LIST, AwsCall, RecordingProxy, price_list
from burstcv_testkit import HELD_WHEEL, launch_of

from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.cost import budget
from burstcv.cost.quotes import SOURCE_BUNDLED, SOURCE_PRICE_LIST, SOURCE_SPOT_HISTORY, quote_uri
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv.stages import data, resolve
from burstcv_spec import storage
from burstcv_spec.contracts import PriceQuote, RunRef, read_artifact

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
