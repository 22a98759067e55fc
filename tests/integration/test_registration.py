"""Registration with DeepSpeed: idempotent, and invisible to engines that use another optimizer.

Each check runs a real ``deepspeed.initialize`` in a fresh single-rank interpreter (it initialises
torch.distributed, which the in-process tests must not see).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.deepspeed  # real deepspeed.initialize in a fresh interpreter per check

REPO = Path(__file__).resolve().parents[2]

ENGINE_CHECK = textwrap.dedent(
    """
    import json, os, socket, sys
    import torch
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    import deepspeed
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime import config as ds_config
    from deepspeed.runtime.zero import utils as zero_utils
    import ds_lioncub
    from ds_lioncub.integration import find_lioncub, register

    HOOKED = ["_configure_distributed_model", "_configure_basic_optimizer", "_do_optimizer_sanity_check",
              "_configure_fp16_optimizer",
              "_configure_zero_optimizer", "_take_model_step",
              "save_checkpoint", "load_checkpoint", "backward"]
    before = [getattr(DeepSpeedEngine, name) for name in HOOKED]
    register(); register()
    report = {
        "same_methods_after_second_register": all(getattr(DeepSpeedEngine, n) is m for n, m in zip(HOOKED, before)),
        "originals_kept": all(hasattr(m, "_lioncub_original") for m in before),
        "name_registered_once": ds_config.DEEPSPEED_OPTIMIZERS.count("lioncub"),
        "zero_list_once": zero_utils.ZERO_SUPPORTED_OPTIMIZERS.count(ds_lioncub.LionCub),
    }
    deepspeed.init_distributed(dist_backend="gloo")

    # Set-up once: every ds_lioncub module's parse_config and build_aggregation counted (those imported later take
    # the counting one from the config and aggregation packages).
    parsed, built = [], []
    def counting(original, calls):
        def counted(*args, **kwargs):
            calls.append(sorted(args[0]) if args and isinstance(args[0], dict) else None)
            return original(*args, **kwargs)
        return counted
    for package, name, calls in (("config", "parse_config", parsed), ("aggregation", "build_aggregation", built)):
        original = getattr(sys.modules[f"ds_lioncub.{package}"], name)
        wrapper = counting(original, calls)
        for module in [m for key, m in list(sys.modules.items()) if key.split(".")[0] == "ds_lioncub"]:
            if getattr(module, name, None) is original:
                setattr(module, name, wrapper)

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))

    def train(engine, net, optimizer=None):
        x = torch.randn(1, 8, generator=torch.Generator().manual_seed(1))
        for _ in range(3):
            loss = net(x).square().sum()
            if engine is None:
                optimizer.zero_grad(); loss.backward(); optimizer.step()
            else:
                engine.backward(loss); engine.step()
        return [p.detach().clone() for p in net.parameters()]

    optimizer_block = json.loads(sys.argv[1])
    config = {"train_batch_size": 1, "optimizer": optimizer_block}
    net = model()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    report["basic_optimizer"] = type(engine.basic_optimizer).__name__
    report["is_lioncub"] = find_lioncub(engine.optimizer) is not None
    report["engine_allreduce"] = engine.enable_backward_allreduce
    lioncub = find_lioncub(engine.optimizer)
    report["gradients_averaged"] = None if lioncub is None else lioncub.gradients_are_averaged
    # A param group's lr, betas and weight_decay are validated on their own when the group is added.
    report["options_parsed"] = [keys for keys in parsed if keys != ["betas", "lr", "weight_decay"]]
    report["groups_checked"] = len(parsed) - len(report["options_parsed"])
    report["aggregations_built"] = len(built)
    trained = train(engine, engine.module)
    if optimizer_block["type"] == "Adam":
        plain = model()
        reference = train(None, plain, torch.optim.Adam(plain.parameters(), lr=optimizer_block["params"]["lr"]))
        report["equals_plain_torch_adam"] = all(torch.equal(a, b) for a, b in zip(trained, reference))
    print("REPORT " + json.dumps(report))
    """
)


def run_engine_check(optimizer_block: dict[str, object]) -> dict[str, object]:
    env = {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", ENGINE_CHECK, json.dumps(optimizer_block)],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    lines = [line for line in done.stdout.splitlines() if line.startswith("REPORT ")]
    assert done.returncode == 0 and lines, f"exit {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return json.loads(lines[-1].removeprefix("REPORT "))


@pytest.fixture(scope="module")
def adam_engine() -> dict[str, object]:
    return run_engine_check({"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True, "adam_w_mode": False}})


def test_a_second_register_patches_nothing_more(adam_engine: dict[str, object]) -> None:
    assert adam_engine["same_methods_after_second_register"] is True
    assert adam_engine["originals_kept"] is True
    assert adam_engine["name_registered_once"] == 1
    assert adam_engine["zero_list_once"] == 1


def test_an_engine_with_another_optimizer_trains_as_deepspeed_alone(adam_engine: dict[str, object]) -> None:
    assert adam_engine["is_lioncub"] is False
    assert adam_engine["options_parsed"] == [] and adam_engine["aggregations_built"] == 0
    assert adam_engine["basic_optimizer"] == "Adam"
    assert adam_engine["engine_allreduce"] is True
    assert adam_engine["equals_plain_torch_adam"] is True


@pytest.fixture(scope="module")
def lioncub_engines() -> dict[str, dict[str, object]]:
    return {
        compression: run_engine_check({"type": "LionCub", "params": {"lr": 1e-3, "compression": compression}})
        for compression in ("1bit", "none")
    }


@pytest.mark.parametrize("compression,engine_allreduce", [("1bit", False), ("none", True)])
def test_the_wiring_decides_who_averages_gradients(
    lioncub_engines: dict[str, dict[str, object]], compression: str, engine_allreduce: bool
) -> None:
    report = lioncub_engines[compression]
    assert report["is_lioncub"] is True
    assert report["engine_allreduce"] is engine_allreduce
    assert report["gradients_averaged"] is (compression == "none")


@pytest.mark.parametrize("compression", ["1bit", "none"])
def test_an_engine_build_parses_the_options_once_and_builds_the_aggregation_once(
    lioncub_engines: dict[str, dict[str, object]], compression: str
) -> None:
    """The ds_config's LionCub block is parsed by the first hook that reads it (the every-rank model check) and
    serves the optimizer's construction too; the aggregation is built by the wiring's bind(), for the ranks that
    vote, not also at construction. Each param group's hyper-parameters are checked on their own."""
    report = lioncub_engines[compression]
    assert report["options_parsed"] == [["compression", "lr"]]
    assert report["groups_checked"] == 1
    assert report["aggregations_built"] == 1
