"""What the default clip costs in the main job: its 1-bit config trained with each clipping, interleaved.

    python -m benchmarks.bench_default_clip [--rounds 3] [--steps 150]

``make train``'s 1-bit run (examples/compare.py's common settings: 2 CPU ranks, the example GPT, 467,584 parameters,
150 steps, gradient_clipping 1.0) under three clippings, one run of each per round in a rotating order so that a
shared machine's load falls on all alike:

- ``mean``: the default since 0.2.0, the ranks' mean gradient clipped by its sketched norm (with the noise scale);
- ``deepspeed``: ``"clip": {"rule": "deepspeed"}``, DeepSpeed's own rule, the default before 0.2.0 (with the noise
  scale's sketch, which runs whenever nothing else sketches);
- ``none``: ``"gradient_clipping": 0`` and ``"telemetry": {"noise_scale": false}``: no clip, no sketch.

Printed per clipping: the median over rounds of the mean training step (forward, backward, ``engine.step()``) and
of ``engine.step()`` alone, in ms, and each as a ratio to ``none`` and to ``deepspeed`` (medians of the rounds'
ratios).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

from examples import compare

CLIPPINGS: dict[str, dict[str, Any]] = {
    "mean": {},
    "deepspeed": {"clip": {"rule": "deepspeed"}},
    "none": {"telemetry": {"noise_scale": False}},
}


def config_of(base: dict[str, Any], clipping: str) -> dict[str, Any]:
    """The 1-bit config with ``clipping``'s options (and gradient_clipping 0 for ``none``)."""
    config = copy.deepcopy(base)
    config["optimizer"]["params"].update(copy.deepcopy(CLIPPINGS[clipping]))
    if clipping == "none":
        config["gradient_clipping"] = 0.0
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    options = parser.parse_args(argv)
    sys.argv = [sys.argv[0], "--steps", str(options.steps)]
    args = compare.parse_args()  # the main job's common settings
    method = next(m for m in compare.METHODS if m.config == "lioncub_1bit")
    original = json.loads((compare.CONFIG_DIR / f"{method.config}.json").read_text())
    base = compare.common_config(original, args)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in CLIPPINGS}
    with tempfile.TemporaryDirectory(prefix="bench_default_clip_") as tmp:
        out = Path(tmp)
        data, _ = compare.build_corpus(args.corpus, args.corpus_bytes)
        corpus_path = out / "corpus.bin"
        corpus_path.write_bytes(data.numpy().tobytes())
        common = ["--steps", str(args.steps), "--seq-len", str(args.seq_len), "--seed", str(args.seed)]
        common += ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--d-model", str(args.d_model)]
        common += ["--corpus", str(corpus_path), "--corpus-bytes", "0"]
        names = list(CLIPPINGS)
        for round_number in range(options.rounds):
            order = names[round_number % len(names) :] + names[: round_number % len(names)]
            for name in order:
                path = out / f"{name}.ds_config.json"
                path.write_text(json.dumps(config_of(base, name), indent=2) + "\n")
                run_dir = out / f"{name}_{round_number}"
                run_dir.mkdir()
                runs[name].append(compare.run_method(method, path, common, args, run_dir))
    print(f"\n{args.steps} steps, {options.rounds} rounds, medians over the rounds")
    print("| clipping | step ms | engine.step() ms | step vs none | step vs deepspeed | engine.step() vs none |")
    print("|---|---|---|---|---|---|")
    for name in names:

        def ratio(key: str, against: str, name: str = name) -> float:
            return statistics.median(r[key] / a[key] for r, a in zip(runs[name], runs[against], strict=True))

        step = statistics.median(r["mean_step_time_s"] for r in runs[name])
        optimizer = statistics.median(r["mean_optimizer_step_time_s"] for r in runs[name])
        print(
            f"| {name} | {1e3 * step:.1f} | {1e3 * optimizer:.2f} | {ratio('mean_step_time_s', 'none'):.3f} "
            f"| {ratio('mean_step_time_s', 'deepspeed'):.3f} | {ratio('mean_optimizer_step_time_s', 'none'):.3f} |"
        )
    for name in names:
        losses = [r["val_loss"] for r in runs[name]]
        print(f"{name}: val loss {losses[0]:.4f} (every round the same: {len(set(losses)) == 1})")


if __name__ == "__main__":
    main()
