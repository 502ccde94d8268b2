"""Run the dataset's Great Expectations suite over a manifest DataFrame and render Data Docs.

Rules that GX cannot state row by row (duplicates, leakage, class counts) are first computed
into per-row columns by ``add_rule_columns``, so GX still names the offending files. Where a
column can carry the reason (the decode error, the file a leak matches), the expectation is
stated on it, so the Data Docs show why as well as how many.
"""

from __future__ import annotations

import functools
import html
import itertools
import logging
import operator
import os
import re
from collections import defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import great_expectations as gx
import great_expectations.expectations as gxe
import numpy as np
import pandas as pd
from great_expectations.data_context.types.base import (
    DataContextConfig,
    InMemoryStoreBackendDefaults,
    ProgressBarsConfig,
)

from burstcv.data.config import ValidationConfig
from burstcv_spec.contracts import ExpectationResult

if TYPE_CHECKING:
    from great_expectations.expectations.expectation import Expectation

logger = logging.getLogger(__name__)

SUITE_NAME = "burstcv_dataset"
MAX_OFFENDING_FILES = 20  # per check, in validation.json and the summary
_DOCS_SITE = "burstcv"
# A difference hash with almost every bit equal comes from a flat or smooth image: two such
# images share a hash without looking alike, so they are left to the exact (sha256) check.
_MIN_INFORMATIVE_BITS = 4
# Beyond this many images with one identical hash the data is degenerate (blank frames, say):
# near-duplicate pairing among them is capped to stay linear (sha256 still finds exact copies).
_MAX_ROWS_PER_HASH = 500
_COUNTED = ("min_images_per_class", "class_imbalance")  # their details list the class counts


@dataclass(frozen=True)
class Check:
    """Name one rule of the suite: the GX expectation and how to explain an offending row."""

    name: str
    description: str
    expectation: Expectation
    reason_column: str | None = None  # manifest column that says why a row offends
    reason_prefix: str = ""


@dataclass
class SuiteOutcome:
    """Hold the suite's verdict, one result per check, and the usable images per class."""

    success: bool
    checks: list[ExpectationResult]
    class_counts: dict[str, dict[str, int]]  # split -> label -> n


def class_counts(
    df: pd.DataFrame, splits: tuple[str, ...] | list[str]
) -> dict[str, dict[str, int]]:
    """Return usable images per split and label (decoded rows in a configured split)."""
    usable = df[usable_mask(df, splits)]
    counts: dict[str, dict[str, int]] = {split: {} for split in splits}
    for (split, label), n in usable.groupby(["split", "label"]).size().items():
        counts[str(split)][str(label)] = int(n)
    return counts


def add_rule_columns(manifest: pd.DataFrame, config: ValidationConfig) -> pd.DataFrame:
    """Return a copy of the manifest with the per-row columns that dataset-level rules check
    (each ``*_of`` column names the matching file)."""
    df = manifest.reset_index(drop=True)  # positions below index rows
    splits = tuple(config.splits)
    usable = usable_mask(df, splits)
    df["usable"] = usable.astype("int64")
    counts = class_counts(df, splits)
    labels = {str(label) for label in df["label"].dropna().unique().tolist()}
    labels |= set(config.expected_classes or [])
    weakest = {label: min(counts[s].get(label, 0) for s in splits) for label in labels}
    # Mapped in pandas: rows without a label (or split) get NA.
    df["class_min_split_count"] = df["label"].map(weakest).astype("Int64")
    ratios: dict[str, float] = {}
    for split, per_label in counts.items():
        present = [n for n in per_label.values() if n > 0]
        if present:
            ratios[split] = max(present) / min(present)
    df["split_imbalance_ratio"] = df["split"].map(ratios).astype("Float64")

    usable_array = usable.to_numpy(dtype=bool)
    dup_of, leak_exact_of = _exact_copies(df, usable_array)
    leak_near_of: list[str | None] = [None] * len(df)
    if config.near_duplicate_max_distance is not None:
        paths = df["path"].tolist()
        for i, j in _near_leaks(df, usable_array, config).items():
            if leak_exact_of[i] is None:
                leak_near_of[i] = paths[j]
    for column, flag, values in (
        ("dup_of", "dup_within_split", dup_of),
        ("leak_exact_of", "leaks_exact", leak_exact_of),
        ("leak_near_of", "leaks_near", leak_near_of),
    ):
        df[column] = pd.Series(values, dtype="object", index=df.index)
        df[flag] = df[column].notna()
    return df


def _exact_copies(
    df: pd.DataFrame, usable: np.ndarray
) -> tuple[list[str | None], list[str | None]]:
    """Return per row the path of an exact copy in its split, and of one in another split."""
    dup_of: list[str | None] = [None] * len(df)
    leak_exact_of: list[str | None] = [None] * len(df)
    paths = df["path"].tolist()
    row_splits = df["split"].tolist()
    # Only rows whose sha256 occurs more than once can be duplicates or leaks: pandas finds
    # them in C, and the Python loop below sees those few rows, not the whole dataset.
    shared_sha = usable & df["sha256"].duplicated(keep=False).to_numpy(dtype=bool)
    shas = df["sha256"].tolist()
    by_sha: dict[str, list[int]] = defaultdict(list)
    for i in np.flatnonzero(shared_sha).tolist():
        by_sha[shas[i]].append(i)
    # Linear in the group size even when thousands of files share one hash.
    for group in by_sha.values():
        by_split: dict[Any, list[int]] = defaultdict(list)
        for i in group:
            by_split[row_splits[i]].append(i)
        for split, members in by_split.items():
            other = next((m[0] for s, m in by_split.items() if s != split), None)
            for i in members:
                if len(members) > 1:
                    dup_of[i] = paths[members[1] if i == members[0] else members[0]]
                if other is not None:
                    leak_exact_of[i] = paths[other]
    return dup_of, leak_exact_of


def _near_leaks(df: pd.DataFrame, usable: np.ndarray, config: ValidationConfig) -> dict[int, int]:
    """Return ``_near_partners`` of the usable rows, by their difference hashes."""
    max_distance = config.near_duplicate_max_distance or 0
    phash_column = df["phash"]
    if phash_column[usable].isna().any():
        raise ValueError(
            "the manifest has no phash for some decoded rows: scan with phash=True, or set "
            "near_duplicate_max_distance=None"
        )
    candidates = usable
    if max_distance == 0:  # partners share the exact hash: only repeated values matter
        candidates = candidates & phash_column.duplicated(keep=False).to_numpy(dtype=bool)
    phashes = phash_column.tolist()
    hashes = {i: int(phashes[i], 16) for i in np.flatnonzero(candidates).tolist()}
    thumbs = df["thumb"].tolist() if "thumb" in df.columns else [None] * len(df)
    return _near_partners(
        hashes, thumbs, df["split"].tolist(), max_distance, config.near_duplicate_max_pixel_diff
    )


def _format_set(config: ValidationConfig) -> list[str]:
    """Return the format names the manifest may show: with JPEG, the MPO that cameras write
    (a multi-picture JPEG the service accepts as JPEG: burstcv_spec.preprocess.probe_image)."""
    formats = list(config.allowed_formats)
    return [*formats, "MPO"] if "JPEG" in formats and "MPO" not in formats else formats


def build_checks(config: ValidationConfig) -> list[Check]:
    """Return the suite's checks, in report order, with thresholds from the config."""
    checks = _file_checks(config) + _dataset_checks(config)
    for check in checks:
        check.expectation.meta = {"name": check.name}
        check.expectation.description = check.description
    return checks


def _file_checks(config: ValidationConfig) -> list[Check]:
    """Return the checks each file must pass on its own, and the splits' presence."""
    splits = list(config.splits)
    return [
        Check(
            "imagefolder_layout",
            "Every file sits at <split>/<class>/<file>",
            gxe.ExpectColumnValuesToNotBeNull(column="label"),
            "error",
        ),
        Check(
            "every_file_decodes",
            "Every file decodes fully with the service's rules",
            # On the error text, not decode_ok: Data Docs then show why files failed.
            gxe.ExpectColumnValuesToBeNull(column="error"),
            "error",
        ),
        Check(
            "allowed_formats",
            f"Image formats are among {', '.join(config.allowed_formats)}",
            gxe.ExpectColumnValuesToBeInSet(column="format", value_set=_format_set(config)),
            "format",
            "format ",
        ),
        *(
            Check(
                f"{side}_in_bounds",
                f"{side.capitalize()} is {low}..{high} px",
                gxe.ExpectColumnValuesToBeBetween(column=side, min_value=low, max_value=high),
                side,
                f"{side} ",
            )
            for side, low, high in (
                ("width", config.min_width, config.max_width),
                ("height", config.min_height, config.max_height),
            )
        ),
        Check(
            "channels_allowed",
            f"Channels are among {', '.join(map(str, config.allowed_channels))}",
            gxe.ExpectColumnValuesToBeInSet(
                column="channels", value_set=list(config.allowed_channels)
            ),
            "mode",
            "mode ",
        ),
        Check(
            "known_splits",
            f"Every split folder is one of {', '.join(splits)}",
            gxe.ExpectColumnValuesToBeInSet(column="split", value_set=splits),
            "split",
            "split ",
        ),
        Check(
            "all_splits_present",
            f"Splits {', '.join(splits)} are all present",
            gxe.ExpectColumnDistinctValuesToContainSet(column="split", value_set=splits),
        ),
    ]


def _dataset_checks(config: ValidationConfig) -> list[Check]:
    """Return the checks on classes, copies and leaks, stated on ``add_rule_columns``'."""
    checks: list[Check] = []
    if config.expected_classes is not None:
        expected = list(config.expected_classes)
        checks += [
            Check(
                "labels_expected",
                f"Every class folder is one of the {len(expected)} expected classes",
                gxe.ExpectColumnValuesToBeInSet(column="label", value_set=expected),
                "label",
                "unexpected class ",
            ),
            Check(
                "expected_classes_present",
                "Every expected class is present",
                gxe.ExpectColumnDistinctValuesToContainSet(column="label", value_set=expected),
            ),
        ]
    checks += [
        Check(
            "min_images_per_class",
            f"Every class has at least {config.min_images_per_class} images in every split",
            gxe.ExpectColumnValuesToBeBetween(
                column="class_min_split_count", min_value=config.min_images_per_class
            ),
            "class_min_split_count",
            "usable images of its class in the weakest split: ",
        ),
        Check(
            "class_imbalance",
            f"Largest/smallest class ratio is at most {config.max_imbalance_ratio} per split",
            gxe.ExpectColumnMaxToBeBetween(
                column="split_imbalance_ratio", max_value=config.max_imbalance_ratio
            ),
        ),
        Check(
            "no_duplicates_within_split",
            "No file is an exact copy (sha256) of another in the same split",
            gxe.ExpectColumnValuesToBeNull(column="dup_of"),
            "dup_of",
            "same bytes as ",
        ),
        Check(
            "no_leakage_exact",
            "No image is shared between splits (same sha256)",
            gxe.ExpectColumnValuesToBeNull(column="leak_exact_of"),
            "leak_exact_of",
            "same bytes as ",
        ),
    ]
    if config.near_duplicate_max_distance is not None:
        checks.append(
            Check(
                "no_leakage_near",
                "No near-duplicate image is shared between splits (difference hash within "
                f"{config.near_duplicate_max_distance} bits, 9x8 thumbnail within "
                f"{config.near_duplicate_max_pixel_diff} grey levels)",
                gxe.ExpectColumnValuesToBeNull(column="leak_near_of"),
                "leak_near_of",
                "looks like ",
            )
        )
    checks.append(
        Check(
            "min_total_images",
            f"At least {config.min_total_images} usable images in all",
            gxe.ExpectColumnSumToBeBetween(column="usable", min_value=config.min_total_images),
        )
    )
    return checks


def run_suite(
    manifest: pd.DataFrame,
    config: ValidationConfig,
    *,
    data_docs_dir: Path | None = None,
) -> SuiteOutcome:
    """Validate a manifest with the suite; write Data Docs under ``data_docs_dir`` if given."""
    df = add_rule_columns(manifest, config)
    checks = build_checks(config)
    context = _context(data_docs_dir)
    batch = (
        context.data_sources.add_pandas("manifest")
        .add_dataframe_asset("manifest")
        .add_batch_definition_whole_dataframe("all_files")
    )
    # Built whole, then stored once: adding expectations one by one to a stored suite saves
    # (and serialises) the suite again after each.
    suite = context.suites.add(
        gx.ExpectationSuite(name=SUITE_NAME, expectations=[c.expectation for c in checks])
    )
    definition = context.validation_definitions.add(
        gx.ValidationDefinition(name="dataset", data=batch, suite=suite)
    )
    result = definition.run(
        batch_parameters={"dataframe": _gx_frame(df, checks)},
        result_format={
            "result_format": "SUMMARY",
            "unexpected_index_column_names": ["path"],
            "partial_unexpected_count": MAX_OFFENDING_FILES,
        },
    )
    by_name = {
        (r.expectation_config.meta or {}).get("name"): r
        for r in result.results
        if r.expectation_config is not None
    }
    missing = [c.name for c in checks if c.name not in by_name]
    if missing:
        raise RuntimeError(f"GX returned no result for checks: {', '.join(missing)}")

    rows = df.set_index("path")
    counts = class_counts(df, tuple(config.splits))
    outcomes = [_check_result(check, by_name[check.name], rows) for check in checks]
    outcomes = [
        o.model_copy(update={"details": {"class_counts": counts}}) if o.name in _COUNTED else o
        for o in outcomes
    ]
    if data_docs_dir is not None:
        context.build_data_docs(site_names=[_DOCS_SITE])
        if not (data_docs_dir / "index.html").is_file():
            raise RuntimeError(f"GX built no Data Docs index at {data_docs_dir / 'index.html'}")
        finish_data_docs(data_docs_dir)
    return SuiteOutcome(bool(result.success), outcomes, counts)


def _context(data_docs_dir: Path | None) -> Any:
    """Return an ephemeral GX context, with a Data Docs site in ``data_docs_dir`` if given."""
    sites: dict[str, Any] = {}
    if data_docs_dir is not None:
        sites[_DOCS_SITE] = {
            "class_name": "SiteBuilder",
            "site_index_builder": {"class_name": "DefaultSiteIndexBuilder"},
            "store_backend": {
                "class_name": "TupleFilesystemStoreBackend",
                "base_directory": str(data_docs_dir),
            },
        }
    return gx.get_context(
        mode="ephemeral",
        project_config=DataContextConfig(
            store_backend_defaults=InMemoryStoreBackendDefaults(init_temp_docs_sites=False),
            data_docs_sites=sites,
            analytics_enabled=False,
            progress_bars=ProgressBarsConfig(globally=False),
        ),
    )


# Shown at the top of every Data Docs page that loads assets from a CDN until Bootstrap's CSS
# loads and its ``d-none`` class hides it: it stays only when there is no internet.
CDN_NOTICE = (
    '<div class="d-none burstcv-offline-note" role="note" style="display:block;margin:0;'
    "padding:.6rem 1rem;background:#fffbea;border-bottom:1px solid #d69e2e;color:#744210;"
    'font:14px/1.4 system-ui,sans-serif">These Great Expectations Data Docs load their styles '
    "and scripts (Bootstrap, jQuery, Vega) from public CDNs, and this browser could not reach "
    "them: without internet access the page shows unstyled and its tables stay empty. The same "
    "results are in the run report (Data checks) and in validation.json.</div>"
)
# On the index, the notice also lists the validation pages: its table of them is drawn by a
# CDN script, so offline it would link nowhere.
_PAGES_HEADING = (
    '<p style="margin:.4rem 0 .2rem;font-weight:600">The validation results on this site:</p>'
)
_BODY_TAG = re.compile(r"<body[^>]*>", re.IGNORECASE)
_CDN_REFERENCE = re.compile(r"""(?:src|href)=["']https?://""", re.IGNORECASE)
_LOCAL_LINK = re.compile(r"""((?:src|href)=["'])((?:\.\./)+)([^"'#?:]+)(["'])""", re.IGNORECASE)


def finish_data_docs(docs_dir: Path) -> None:
    """Make GX's Data Docs pages say what they need from the internet (:data:`CDN_NOTICE`),
    and point the favicon links GX gets wrong (one folder too few) at the file they meant."""
    for page in sorted(docs_dir.rglob("*.html")):
        text = page.read_text(encoding="utf-8")
        fixed = _LOCAL_LINK.sub(functools.partial(_repaired_link, page=page, root=docs_dir), text)
        body = _BODY_TAG.search(fixed)
        if body and _CDN_REFERENCE.search(fixed) and "burstcv-offline-note" not in fixed:
            notice = _offline_notice(docs_dir) if page == docs_dir / "index.html" else CDN_NOTICE
            fixed = fixed[: body.end()] + notice + fixed[body.end() :]
        if fixed != text:
            page.write_text(fixed, encoding="utf-8")


def _offline_notice(docs_dir: Path) -> str:
    """Return the index's notice with a plain list of links to every validation page."""
    pages = sorted(docs_dir.glob("validations/**/*.html"))
    if not pages:
        return CDN_NOTICE
    items = "".join(
        f'<li><a href="{html.escape(p.relative_to(docs_dir).as_posix())}">'
        f"{html.escape(p.relative_to(docs_dir / 'validations').with_suffix('').as_posix())}"
        "</a></li>"
        for p in pages
    )
    listing = f'{_PAGES_HEADING}<ul style="margin:0;padding-left:1.2rem">{items}</ul>'
    return CDN_NOTICE.removesuffix("</div>") + listing + "</div>"


def _repaired_link(match: re.Match[str], *, page: Path, root: Path) -> str:
    """Return a relative link unchanged if it resolves, else re-pointed at the site's file."""
    head, ups, rest, tail = match.groups()
    meant = root / rest  # GX's links are relative to the site root
    if (page.parent / ups / rest).resolve().exists() or not meant.is_file():
        return match.group(0)
    return f"{head}{os.path.relpath(meant, page.parent).replace(os.sep, '/')}{tail}"


def _check_result(check: Check, result: Any, rows: pd.DataFrame) -> ExpectationResult:
    raw = result.to_json_dict()
    payload: dict[str, Any] = raw.get("result") or {}
    exception = raw.get("exception_info") or {}
    if exception.get("raised_exception"):
        # GX could not evaluate the rule: the check fails and says why, never passes silently.
        observed: Any = {"exception": exception.get("exception_message")}
    elif "observed_value" in payload and payload["observed_value"] is not None:
        observed = payload["observed_value"]
    elif "partial_missing_list" in payload:
        observed = {"missing": payload["partial_missing_list"]}
    else:
        # A map expectation's observation is its counts; None when GX had nothing to measure.
        observed = {
            key: payload[key]
            for key in ("element_count", "unexpected_count", "unexpected_percent")
            if key in payload
        } or None
    offending = [
        str(item["path"])
        for item in payload.get("partial_unexpected_index_list") or []
        if isinstance(item, dict) and item.get("path") is not None
    ][:MAX_OFFENDING_FILES]
    reasons: dict[str, str] = {}
    if check.reason_column is not None:
        for path in offending:
            value = rows.at[path, check.reason_column] if path in rows.index else None
            if value is not None and not pd.isna(value):
                reasons[path] = f"{check.reason_prefix}{value}"
    return ExpectationResult(
        name=check.name,
        description=check.description,
        expectation_type=str(raw["expectation_config"]["type"]),
        success=bool(raw["success"]),
        observed=observed,
        offending_files=offending,
        reasons=reasons,
    )


def _gx_frame(df: pd.DataFrame, checks: list[Check]) -> pd.DataFrame:
    """Return the columns the suite reads (and path), in GX's fastest dtypes: numpy numbers
    for the between-checks (GX calls Python per row on nullable Int64/Float64)."""
    wanted = {"path"} | {str(getattr(check.expectation, "column", "")) for check in checks}
    between = tuple(
        str(check.expectation.column)
        for check in checks
        if isinstance(check.expectation, gxe.ExpectColumnValuesToBeBetween)
    )
    columns = [name for name in df.columns if name in wanted]
    return _arrow_strings(_numpy_numbers(df[columns], between))


def _arrow_strings(df: pd.DataFrame) -> pd.DataFrame:
    """Return df with its text columns (str or missing) as Arrow-backed strings: GX's null
    test per expectation then reads a bitmap, not objects (half its time on large manifests)."""
    dtypes = {
        name: pd.StringDtype("pyarrow")
        for name in df.columns
        if df[name].dtype == object
        and pd.api.types.infer_dtype(df[name], skipna=True) in ("string", "empty")
    }
    return df.astype(dtypes) if dtypes else df


def _numpy_numbers(df: pd.DataFrame, columns: tuple[str, ...]) -> pd.DataFrame:
    """Return df with nullable numeric columns as numpy int64 (no nulls) or float64 (NaN)."""
    dtypes = {}
    for name in columns:
        column = df[name]
        if isinstance(column.dtype, pd.api.extensions.ExtensionDtype):
            dtypes[name] = "float64" if column.isna().any() else "int64"
    return df.astype(dtypes) if dtypes else df


def usable_mask(df: pd.DataFrame, splits: tuple[str, ...] | list[str]) -> pd.Series:
    """Return True for rows that decoded, have a label and sit in one of ``splits``."""
    return df["decode_ok"].astype(bool) & df["label"].notna() & df["split"].isin(list(splits))


def _near_partners(
    hashes: dict[int, int],
    thumbs: list[str | None],
    splits: list[Any],
    max_distance: int,
    max_pixel_diff: int,
) -> dict[int, int]:
    """Map rows (``hashes``: row -> hash) to a near-duplicate row of another split: hashes
    within max_distance bits, and no pixel of their 9x8 thumbnails more than max_pixel_diff
    apart (a row without a thumbnail is confirmed by the hash)."""
    rows_by_value: dict[int, list[int]] = defaultdict(list)
    for i, value in hashes.items():
        if _MIN_INFORMATIVE_BITS <= value.bit_count() <= 64 - _MIN_INFORMATIVE_BITS:
            rows_by_value[value].append(i)
    oversized = [v for v, rows in rows_by_value.items() if len(rows) > _MAX_ROWS_PER_HASH]
    for value in oversized:
        logger.warning(
            "%d images share difference hash %016x; comparing the first %d for near duplicates",
            len(rows_by_value[value]),
            value,
            _MAX_ROWS_PER_HASH,
        )
        rows_by_value[value] = rows_by_value[value][:_MAX_ROWS_PER_HASH]

    partners: dict[int, int] = {}

    def confirm(i: int, j: int) -> bool:
        a, b = thumbs[i], thumbs[j]
        if not isinstance(a, str) or not isinstance(b, str):
            return True
        pixel_diffs = map(operator.sub, bytes.fromhex(a), bytes.fromhex(b))
        return bool(max(map(abs, pixel_diffs)) <= max_pixel_diff)

    def link(rows_a: list[int], rows_b: list[int]) -> None:
        for i in rows_a:
            for j in rows_b:
                if splits[i] != splits[j] and confirm(i, j):
                    partners.setdefault(i, j)
                    partners.setdefault(j, i)
                    break

    for rows in rows_by_value.values():
        if len(rows) > 1 and len({splits[i] for i in rows}) > 1:
            link(rows, rows)
    if max_distance > 0:
        for a, b in _close_pairs(rows_by_value, max_distance):
            link(rows_by_value[a], rows_by_value[b])
    return partners


def _close_pairs(values: Collection[int], max_distance: int) -> Iterator[tuple[int, int]]:
    """Yield each pair of distinct values within max_distance bits once, by pigeonhole: of
    max_distance + 1 bands of the 64 bits, two such values agree on at least one."""
    bands = max_distance + 1
    edges = [round(64 * b / bands) for b in range(bands + 1)]
    compared: set[tuple[int, int]] = set()
    for low, high in itertools.pairwise(edges):
        mask = (1 << (high - low)) - 1
        buckets: dict[int, list[int]] = defaultdict(list)
        for value in values:
            buckets[(value >> low) & mask].append(value)
        for bucket in buckets.values():
            for a_pos, a in enumerate(bucket):
                for b in bucket[a_pos + 1 :]:
                    if (a, b) not in compared:
                        compared.add((a, b))
                        if (a ^ b).bit_count() <= max_distance:
                            yield a, b
