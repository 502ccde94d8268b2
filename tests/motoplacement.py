"""Teach the in-process AWS emulator (moto) EC2's placement groups, which it does not emulate.

Create, describe (by name, or by tag and group-name filters) and delete, with the tags given
at creation and EC2's own refusals (a duplicate name, an unknown one). The groups live on
moto's EC2 backend of the account and region, so an emulator reset forgets them as it
forgets instances. RunInstances' ``Placement.GroupName`` is checked against them: a launch
into a group that does not exist is refused, as EC2 refuses it.
"""

from __future__ import annotations

import uuid
from typing import Any

_INSTALLED: list[bool] = []


def _groups(backend: Any) -> dict[str, dict[str, Any]]:
    store: dict[str, dict[str, Any]] = backend.__dict__.setdefault("_placement_groups", {})
    return store


def install() -> None:
    """Add the placement-group actions to moto's EC2 responses (once per process)."""
    if _INSTALLED:
        return
    from moto.core.responses import ActionResult, EmptyResult
    from moto.ec2.exceptions import EC2ClientError
    from moto.ec2.responses import EC2Response
    from moto.ec2.responses.instances import InstanceResponse

    def create_placement_group(self: Any) -> Any:
        name = self._get_param("GroupName")
        self.error_on_dryrun()
        groups = _groups(self.ec2_backend)
        if name in groups:
            raise EC2ClientError(
                "InvalidPlacementGroup.Duplicate", f"The placement group '{name}' already exists."
            )
        tags = self._parse_tag_specification().get("placement-group", {})
        groups[name] = {
            "GroupName": name,
            "GroupId": f"pg-{uuid.uuid4().hex[:17]}",
            "Strategy": self._get_param("Strategy", "cluster"),
            "State": "available",
            "Tags": [{"Key": k, "Value": v} for k, v in tags.items()],
        }
        return ActionResult({"PlacementGroup": groups[name]})

    def describe_placement_groups(self: Any) -> Any:
        names = self._get_param("GroupNames", [])
        filters = self._filters_from_querystring()
        groups = _groups(self.ec2_backend)
        unknown = [n for n in names if n not in groups]
        if unknown:
            raise EC2ClientError(
                "InvalidPlacementGroup.Unknown", f"The Placement Group '{unknown[0]}' is unknown."
            )
        found = [groups[n] for n in names] if names else list(groups.values())
        for key, values in filters.items():
            if key == "group-name":
                found = [g for g in found if g["GroupName"] in values]
            elif key.startswith("tag:"):
                tag = key.removeprefix("tag:")
                found = [
                    g
                    for g in found
                    if any(t["Key"] == tag and t["Value"] in values for t in g["Tags"])
                ]
            else:
                raise EC2ClientError("InvalidParameterValue", f"The filter '{key}' is invalid")
        return ActionResult({"PlacementGroups": found})

    def delete_placement_group(self: Any) -> Any:
        name = self._get_param("GroupName")
        self.error_on_dryrun()
        if _groups(self.ec2_backend).pop(name, None) is None:
            raise EC2ClientError(
                "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
            )
        return EmptyResult()

    run_instances = InstanceResponse.run_instances

    def run_instances_into_a_known_group(self: Any) -> Any:
        name = self._get_param("Placement.GroupName")
        if not name:
            return run_instances(self)
        if name not in _groups(self.ec2_backend):
            raise EC2ClientError(
                "InvalidPlacementGroup.Unknown", f"The Placement Group '{name}' is unknown."
            )
        before = {i.id for i in self.ec2_backend.all_instances()}
        result = run_instances(self)
        for instance in self.ec2_backend.all_instances():
            if instance.id not in before:
                instance.placement.group_name = name
        return result

    EC2Response.create_placement_group = create_placement_group  # type: ignore[attr-defined]
    EC2Response.describe_placement_groups = describe_placement_groups  # type: ignore[attr-defined]
    EC2Response.delete_placement_group = delete_placement_group  # type: ignore[attr-defined]
    EC2Response.run_instances = run_instances_into_a_known_group  # type: ignore[method-assign]
    _INSTALLED.append(True)
