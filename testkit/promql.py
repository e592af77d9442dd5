"""PromQL as the tests read it: the metrics the picker's code exports, and the series selectors
and grouping labels of a query (the dashboard's, tests/deploy/test_dashboard.py; docs/metrics.md's,
tests/telemetry/test_metrics_doc.py).

Exported names come from the code: every metric constructor call in extproc/telemetry/*.py
(Counter, Histogram, Gauge, Summary, *MetricFamily) with a literal name (or a sum of literals and
the module's own string constants, as `PREFIX + "queue_size"`), expanded the way prometheus_client
exposes them (counters get _total, histograms _bucket/_sum/_count).
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

from testkit.helm import REPO_ROOT

METRIC_SOURCES = sorted((REPO_ROOT / "extproc" / "telemetry").glob("*.py"))
# Labels Prometheus adds to every scraped series (kubernetes_sd / ServiceMonitor relabelling).
TARGET_LABELS = {"namespace", "pod", "job", "instance", "service", "container", "endpoint", "le"}
PROMQL_WORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "and", "or", "unless",
                "offset", "inf", "nan"}


@dataclass(frozen=True)
class Metric:
    name: str
    kind: str
    labels: frozenset[str]


def _literal_strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.List | ast.Tuple):
        return [e.value for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
    return []


def _string(node: ast.AST, constants: dict[str, str]) -> str | None:
    """The value of a string literal, a module string constant, or a `+` of them; None otherwise."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.Name):
        return constants.get(node.id)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = _string(node.left, constants), _string(node.right, constants)
        return None if left is None or right is None else left + right
    return None


def _module_constants(tree: ast.Module) -> dict[str, str]:
    """Module-level `NAME = "text"` assignments."""
    out: dict[str, str] = {}
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            value = _string(stmt.value, out)
            if value is not None:
                out[stmt.targets[0].id] = value
    return out


def exported_metrics(paths: list[Path]) -> dict[str, Metric]:
    """Series name -> Metric for every metric the picker's code constructs."""
    kinds = {"Counter": "counter", "CounterMetricFamily": "counter", "Histogram": "histogram",
             "HistogramMetricFamily": "histogram", "Gauge": "gauge", "GaugeMetricFamily": "gauge",
             "Summary": "summary", "SummaryMetricFamily": "summary", "Info": "info", "InfoMetricFamily": "info"}
    out: dict[str, Metric] = {}
    for path in paths:
        tree = ast.parse(path.read_text())
        constants = _module_constants(tree)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            cls = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if cls not in kinds or not node.args:
                continue
            name = _string(node.args[0], constants)
            if name is None:
                continue
            labels = _literal_strings(node.args[2] if len(node.args) > 2 else None)
            for kw in node.keywords:
                if kw.arg in ("labels", "labelnames"):
                    labels = _literal_strings(kw.value)
            kind = kinds[cls]
            metric = Metric(name, kind, frozenset(labels))
            base = name
            if kind == "counter":
                base = base.removesuffix("_total")
                names = [base + "_total"]
            elif kind == "histogram":
                names = [base + "_bucket", base + "_sum", base + "_count"]
            elif kind == "info":
                names = [base.removesuffix("_info") + "_info"]
            else:
                names = [base]
            for series in names:
                out[series] = metric
    return out


EXPORTED = exported_metrics(METRIC_SOURCES)


def selectors(expr: str) -> list[tuple[str, set[str]]]:
    """(metric name, label names in its {...} matcher) for every series selector of a PromQL query."""
    expr = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    expr = re.sub(r"\[[^\]]*\]", "", expr)  # range selectors
    found: list[tuple[str, set[str]]] = []
    for m in re.finditer(r"([A-Za-z_:][A-Za-z0-9_:]*)\s*(\{[^}]*\})?", expr):
        name, matcher = m.group(1), m.group(2) or ""
        rest = expr[m.end():].lstrip()
        before = expr[:m.start()].rstrip()
        if name in PROMQL_WORDS or (not matcher and re.match(r"(\(|(by|without)\s*\()", rest)):
            continue  # keyword, function call or aggregation
        if re.search(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*$", before):
            continue  # a label name in a grouping clause
        if name.startswith("$") or re.fullmatch(r"[0-9.e+-]+", name):
            continue
        labels = set(re.findall(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)", matcher))
        found.append((name, labels))
    return found


def grouping_labels(expr: str) -> set[str]:
    labels: set[str] = set()
    for group in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        labels |= {label.strip() for label in group.split(",") if label.strip()}
    return labels
