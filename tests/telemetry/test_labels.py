"""Client-chosen model names never grow /metrics without bound (extproc/telemetry/labels.py)."""

from __future__ import annotations

import random
import string

from prometheus_client import generate_latest

from extproc.telemetry.labels import MAX_LEARNED, OTHER, ModelLabels
from testkit.extproc_stream import body_msgs, drive, headers_msg, make_app


def test_known_names_keep_their_label_others_are_other() -> None:
    labels = ModelLabels(["llama"])
    labels.learn(["qwen", ""])
    assert labels.label("llama") == "llama" and labels.label("qwen") == "qwen"
    assert labels.label("anything else") == OTHER and labels.label("") == ""
    labels.learn(f"lora-{i}" for i in range(MAX_LEARNED * 2))
    assert len(labels) <= MAX_LEARNED + 1


async def test_thousands_of_random_model_names_keep_metrics_bounded() -> None:
    app = make_app(model_names=("llama",))
    app.metrics.models.learn(["engine-model"])

    async def send(model: str, valid: bool = True) -> None:
        body = (b'{"model": "' + model.encode() + b'", "prompt": "hi"}') if valid else \
            (b'{"model": "' + model.encode() + b'", "prompt": 5}')
        await drive(app, [headers_msg(), *body_msgs(body)])

    for name in ("llama", "engine-model"):
        await send(name)
    before = len(generate_latest(app.metrics.registry))
    rng = random.Random(4)
    for i in range(3000):
        name = "".join(rng.choice(string.ascii_letters) for _ in range(24))
        await send(name, valid=i % 3 != 0)  # routed and rejected requests both carry the model label
    text = generate_latest(app.metrics.registry).decode()
    assert len(text) < before + 2000, (before, len(text))
    assert 'model_name="other"' in text and 'model_name="llama"' in text and 'model_name="engine-model"' in text
    total = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("inference_objective_request_total{"))
    assert total == 3002
