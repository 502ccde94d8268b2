"""Price any region and type from AWS, as the orchestrator does at validate, provision and teardown.

eu-west-1 and g5.2xlarge are in no row of the bundled table. On-demand prices come from the
AWS Price List API, which the emulator does not model: the recording proxy answers
``pricing:GetProducts`` with a response in the API's documented shape (the call is still
audited against deploy/iam-policy.json); spot prices come from the emulator's
DescribeSpotPriceHistory for the AZ launched. Every quote is cached in the artifact store
with its date and source; the bundled table answers only when AWS cannot.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from awsaudit import RecordingProxy
from burstcv_testkit import HELD_WHEEL, launch_of

from burstcv import pipeline
from burstcv.compute.ec2 import Ec2Backend, Ec2Settings
from burstcv.cost import budget
from burstcv.cost.quotes import SOURCE_PRICE_LIST, SOURCE_SPOT_HISTORY, quote_uri
from burstcv.params import RunParams
from burstcv.settings import Settings
from burstcv_spec import storage
from burstcv_spec.contracts import PriceQuote, RunRef, read_artifact

REGION = "eu-west-1"
TYPE = "g5.2xlarge"  # neither in the bundled table
ON_DEMAND_USD = "1.3180000000"


def price_list_answer(instance_type: str, usd: str) -> bytes:
    """Return a GetProducts response as the Price List API sends it (PriceList: JSON strings)."""
    product = {
        "product": {
            "productFamily": "Compute Instance",
            "attributes": {
                "instanceType": instance_type,
                "regionCode": REGION,
                "operatingSystem": "Linux",
                "tenancy": "Shared",
                "preInstalledSw": "NA",
                "capacitystatus": "Used",
            },
            "sku": "8VCNEHQMSCQS4P39",
        },
        "serviceCode": "AmazonEC2",
        "terms": {
            "OnDemand": {
                "8VCNEHQMSCQS4P39.JRTCKXETXF": {
                    "priceDimensions": {
                        "8VCNEHQMSCQS4P39.JRTCKXETXF.6YS6EN2CT7": {
                            "unit": "Hrs",
                            "pricePerUnit": {"USD": usd},
                            "description": f"${usd} per On Demand Linux {instance_type} Hour",
                        }
                    },
                    "effectiveDate": "2026-11-01T00:00:00Z",
                }
            }
        },
        "version": "20261101000000",
        "publicationDate": "2026-11-01T00:00:00Z",
    }
    return json.dumps({"FormatVersion": "aws_v1", "PriceList": [json.dumps(product)]}).encode()


@pytest.fixture
def far_deployment(
    s3_deployment: Settings, monkeypatch: pytest.MonkeyPatch, audited_calls: RecordingProxy
) -> Settings:
    """Configure a deployment in eu-west-1 with the Price List API answering a recorded response."""
    monkeypatch.setenv("BURSTCV_EC2_REGION", REGION)
    monkeypatch.setenv("BURSTCV_EC2_INSTANCE_TYPES", TYPE)
    audited_calls.answers["pricing:GetProducts"] = (200, price_list_answer(TYPE, ON_DEMAND_USD))
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
    budget_s = budget.bounded_time_budget(params(), far_deployment)
    assert budget_s == int(1.0 / float(ON_DEMAND_USD) * 3600)  # $1 at $1.318/h: 45 min
    (call,) = [c for c in audited_calls.snapshot() if c.action == "pricing:GetProducts"]
    assert call.region == "us-east-1"  # the Price List API's endpoint, for every region
    assert {"Field": "regionCode", "Type": "TERM_MATCH", "Value": REGION} in call.params["Filters"]
    cached = read_artifact(
        quote_uri(far_deployment.artifact_root, TYPE, REGION, "on-demand", ""), PriceQuote
    )
    assert cached.usd_per_hour == pytest.approx(1.318)
    assert cached.source == SOURCE_PRICE_LIST and cached.fetched_at and cached.as_of

    audited_calls.clear()
    assert budget.bounded_time_budget(params(), far_deployment) == budget_s
    assert "pricing:GetProducts" not in actions(audited_calls)  # fresh in the store: not asked


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

    quoted = backend.price_quote(info)  # what its launch record bills it at
    assert backend.terminate_run("far-spot") == [iid]

    spot = read_artifact(
        quote_uri(far_deployment.artifact_root, TYPE, REGION, "spot", info.zone), PriceQuote
    )
    assert spot.source == SOURCE_SPOT_HISTORY and spot.zone == info.zone
    assert quoted is not None and quoted.usd_per_hour == spot.usd_per_hour
    history = [c for c in audited_calls.snapshot() if c.action == "ec2:DescribeSpotPriceHistory"]
    assert history and history[0].region == REGION


def test_without_aws_the_bundled_table_answers_and_says_so(
    s3_deployment: Settings, audited_calls: RecordingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    denied = json.dumps({"__type": "AccessDeniedException", "Message": "no"}).encode()
    audited_calls.answers["pricing:GetProducts"] = (400, denied)
    monkeypatch.setenv("BURSTCV_EC2_REGION", "us-east-1")

    prices = budget.candidate_prices(["g6.xlarge"], s3_deployment)

    assert prices == {"g6.xlarge": 0.8048}
    cached_uri = quote_uri(s3_deployment.artifact_root, "g6.xlarge", "us-east-1", "on-demand", "")
    assert not storage.exists(cached_uri)  # a fallback is not cached as if AWS had said it


def test_a_type_nobody_prices_counts_at_the_highest_known_price(
    far_deployment: Settings, audited_calls: RecordingProxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    nothing = json.dumps({"FormatVersion": "aws_v1", "PriceList": []}).encode()
    audited_calls.answers["pricing:GetProducts"] = (200, nothing)
    monkeypatch.setenv("BURSTCV_EC2_REGION", "us-east-1")
    # g5.2xlarge has no price anywhere; g6.xlarge is in the bundled table for us-east-1.
    run = params(instance_types=[TYPE, "g6.xlarge"], max_cost_usd=0.8048)
    assert budget.bounded_time_budget(run, far_deployment) == 3600


def test_a_run_nobody_can_price_fails_at_validate_with_one_line(
    far_deployment: Settings, audited_calls: RecordingProxy
) -> None:
    audited_calls.answers["pricing:GetProducts"] = (
        400,
        json.dumps({"__type": "AccessDeniedException", "Message": "not allowed"}).encode(),
    )
    with pytest.raises(pipeline.ValidationFailed) as failed:
        pipeline.validate(RunRef.of("manual__unpriced"), params(), far_deployment)
    line = str(failed.value)
    assert "\n" not in line and TYPE in line and REGION in line
    assert "pricing:GetProducts" in line and "BURSTCV_PRICE_TABLE" in line
    assert not [c for c in audited_calls.snapshot() if c.action.startswith("ec2:Run")]
