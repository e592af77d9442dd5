"""Bounded label values for model names: a client chooses the `model` string, so it must not
choose how many Prometheus series the picker keeps.

A model name keeps its own label value when the picker knows it from
- `--model-names` (a configured list), or
- the engines themselves: the `model_name` label of their scraped `vllm:num_requests_running`
  series and the LoRA adapters of `vllm:lora_requests_info` (extproc/scraping/scraper.py calls
  `learn`). InferenceObjectives (v1) name no model, so they add nothing here.
Every other name is counted under the fixed value `OTHER`. Learned names are capped at
`MAX_LEARNED` (engines report a handful; the cap only guards against a misbehaving one).
The empty name (bodiless requests such as GET /v1/models) stays empty.
"""

from __future__ import annotations

from collections.abc import Iterable

OTHER = "other"
MAX_LEARNED = 1000


class ModelLabels:
    __slots__ = ("_configured", "_learned")

    def __init__(self, configured: Iterable[str]) -> None:
        self._configured = frozenset(n for n in configured if n)
        self._learned: set[str] = set()

    def learn(self, names: Iterable[str]) -> None:
        """Names reported by an engine (runs on the event loop, from the scraper)."""
        for name in names:
            if name and name not in self._learned and len(self._learned) < MAX_LEARNED:
                self._learned.add(name)

    def label(self, model: str) -> str:
        if not model or model in self._configured or model in self._learned:
            return model
        return OTHER

    def __len__(self) -> int:
        return len(self._configured | self._learned)
