"""Validate custom resources against the vendored upstream CRDs (testkit/crds/schemas/), the way the
API server of a cluster with those CRDs installed would, as far as that can be done offline.

Per (project, version) of testkit/crds/schemas/SOURCES.yaml, every served version of every CRD is
turned into a JSON schema (`to_json_schema`):
- an object schema with `properties` and neither `additionalProperties` nor
  `x-kubernetes-preserve-unknown-fields` gets `additionalProperties: false`: kubectl's default
  strict field validation rejects unknown fields (the API server would otherwise prune them
  silently, which is worse: the setting is lost);
- `nullable: true` also admits null; `x-kubernetes-int-or-string` admits an integer or a string;
  OpenAPI 3.0's boolean `exclusiveMaximum`/`exclusiveMinimum` become JSON-schema bounds;
- `metadata` is the CRD's (a plain object).
Then the CEL rules (`x-kubernetes-validations`) are evaluated with cel-python against the value
at their node, for every node of the object the schema reaches. Rules that use `oldSelf`
(transition rules, only meaningful on update) or Kubernetes CEL library functions cel-python does
not have (e.g. `isURL`, `quantity`, `format`) cannot be evaluated offline; `CelReport` counts
them so a test can assert how many rules really ran.
Before use, each vendored file is checked against the SHA-256 recorded in SOURCES.yaml.
"""

from __future__ import annotations

import copy
import gzip
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import celpy
import celpy.adapter
import celpy.evaluation
import jsonschema  # type: ignore[import-untyped]
import yaml

CRDS = Path(__file__).parent / "crds" / "schemas"

Obj = dict[str, Any]


class CrdUnknown(LookupError):
    """No vendored CRD of this (project, version) defines the object's apiVersion and kind."""


@dataclass
class CelReport:
    evaluated: int = 0  # rules that ran
    skipped_transition: int = 0  # rules with oldSelf
    skipped_unsupported: int = 0  # rules cel-python cannot compile or run
    evaluated_rules: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class Crd:
    name: str
    group: str
    kind: str
    versions: dict[str, Obj]  # served version -> openAPIV3Schema


@cache
def sources() -> list[Obj]:
    records: list[Obj] = yaml.safe_load((CRDS / "SOURCES.yaml").read_text())["crds"]
    return records


def read_crd(relative: str) -> Obj:
    """The vendored CRD document, checked against the SHA-256 recorded in SOURCES.yaml."""
    [record] = [r for r in sources() if r["file"] == relative]
    text = gzip.decompress((CRDS / relative).read_bytes())
    digest = hashlib.sha256(text).hexdigest()
    if digest != record["sha256"]:
        raise AssertionError(f"{relative}: sha256 {digest} differs from SOURCES.yaml ({record['sha256']})")
    crd: Obj = yaml.safe_load(text)
    return crd


@cache
def crds(project: str, version: str) -> dict[tuple[str, str], Crd]:
    """(apiVersion, kind) -> CRD, for the vendored CRDs of one release of one project."""
    out: dict[tuple[str, str], Crd] = {}
    for record in sources():
        if not record["file"].startswith(f"{project}/{version}/"):
            continue
        doc = read_crd(record["file"])
        spec = doc["spec"]
        served = {v["name"]: v["schema"]["openAPIV3Schema"] for v in spec["versions"] if v.get("served", True)}
        crd = Crd(doc["metadata"]["name"], spec["group"], spec["names"]["kind"], served)
        for name in served:
            out[(f"{crd.group}/{name}", crd.kind)] = crd
    if not out:
        raise AssertionError(f"no vendored CRDs for {project} {version} under {CRDS}")
    return out


def to_json_schema(schema: Obj) -> Obj:
    """A JSON-schema (draft 2020-12) reading of a CRD's structural OpenAPI v3 schema."""
    out = copy.deepcopy(schema)

    def fix(node: Any) -> None:
        if isinstance(node, list):
            for item in node:
                fix(item)
            return
        if not isinstance(node, dict):
            return
        for key in ("properties", "patternProperties"):
            for sub in (node.get(key) or {}).values():
                fix(sub)
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                fix(node[key])
        for key in ("allOf", "anyOf", "oneOf"):
            if isinstance(node.get(key), list):
                fix(node[key])
        for bound in ("Maximum", "Minimum"):  # OpenAPI 3.0 booleans -> JSON-schema numbers
            flag = node.get(f"exclusive{bound}")
            if isinstance(flag, bool):
                del node[f"exclusive{bound}"]
                if flag and bound.lower() in node:
                    node[f"exclusive{bound}"] = node.pop(bound.lower())
        if node.get("x-kubernetes-int-or-string"):
            node["type"] = ["integer", "string"]
        if node.get("nullable") and isinstance(node.get("type"), str):
            node["type"] = [node["type"], "null"]
        if ("properties" in node and "additionalProperties" not in node
                and not node.get("x-kubernetes-preserve-unknown-fields")):
            node["additionalProperties"] = False

    fix(out)
    return out


@cache
def _validator(project: str, version: str, api_version: str, kind: str) -> tuple[Any, Obj]:
    table = crds(project, version)
    if (api_version, kind) not in table:
        known = sorted(f"{k}.{a}" for a, k in table)
        raise CrdUnknown(f"{kind} {api_version} is not defined by {project} {version}'s CRDs (known: {known})")
    schema = table[(api_version, kind)].versions[api_version.split("/")[1]]
    json_schema = to_json_schema(schema)
    jsonschema.Draft202012Validator.check_schema(json_schema)
    return jsonschema.Draft202012Validator(json_schema), schema


def _rule_nodes(schema: Obj, value: Any, path: str) -> Iterator[tuple[str, Obj, Any]]:
    """(path, rule, value) for every CEL rule reached by `value`."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path, rule, value
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        extra = schema.get("additionalProperties")
        for key, sub in value.items():
            if key in props:
                yield from _rule_nodes(props[key], sub, f"{path}.{key}")
            elif isinstance(extra, dict):
                yield from _rule_nodes(extra, sub, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(value):
            yield from _rule_nodes(schema["items"], item, f"{path}[{i}]")


@cache
def _program(rule: str) -> Any:
    env = celpy.Environment()
    return env.program(env.compile(rule))


def cel_errors(schema: Obj, obj: Obj, report: CelReport) -> list[str]:
    errors = []
    for path, rule, value in _rule_nodes(schema, obj, ""):
        text: str = rule["rule"]
        if "oldSelf" in text:
            report.skipped_transition += 1
            continue
        try:
            result = _program(text).evaluate({"self": celpy.adapter.json_to_cel(value)})
        except Exception:  # cel-python raises several kinds for unsupported functions
            report.skipped_unsupported += 1
            continue
        if isinstance(result, celpy.evaluation.CELEvalError):
            report.skipped_unsupported += 1
            continue
        report.evaluated += 1
        report.evaluated_rules.add(text)
        if not bool(result):
            errors.append(f"{path or '<root>'}: {rule.get('message') or 'failed rule'} (CEL: {text})")
    return errors


def errors(obj: Obj, project: str, version: str, report: CelReport | None = None) -> list[str]:
    """Every problem of `obj` against `project` `version`'s CRD; raises CrdUnknown for an unknown kind."""
    validator, schema = _validator(project, version, obj.get("apiVersion", ""), obj.get("kind", ""))
    out = [f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
           for e in validator.iter_errors(obj)]
    spec_schema = {k: v for k, v in schema.items() if k != "properties"} | {
        "properties": {k: v for k, v in (schema.get("properties") or {}).items() if k != "metadata"}}
    out += cel_errors(spec_schema, obj, report if report is not None else CelReport())
    return out


def defines(project: str, version: str, api_version: str, kind: str) -> bool:
    return (api_version, kind) in crds(project, version)
