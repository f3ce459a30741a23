import pytest
import torch

from benchmarks import harness, worker
from benchmarks.models import MODELS


def test_harness_defaults():
    a = harness.parse_args([])
    assert a.models == ["vgg", "gpt"]
    assert a.rates == ["1gbit"]
    assert a.ranks == 2
    assert a.schemes == list(worker.SCHEMES)
    assert a.network == "auto"
    assert a.name == "vgg-gpt-1gbit-2r"


def test_harness_lists_and_overrides():
    a = harness.parse_args([
        "--models", "vgg, gpt", "--rates", "1gbit,10gbit", "--ranks", "4", "--iters", "7",
        "--warmup", "0", "--rounds", "2", "--schemes", "compute,comm,ddp,dc-dcredit",
        "--batch-sizes", "vgg=8,gpt=3", "--network", "loopback", "--name", "x",
    ])
    assert a.models == ["vgg", "gpt"]
    assert a.rates == ["1gbit", "10gbit"]
    assert (a.ranks, a.iters, a.warmup, a.rounds) == (4, 7, 0, 2)
    assert a.schemes == ["compute", "comm", "ddp", "dc-dcredit"]
    assert a.batch_sizes == {"vgg": 8, "gpt": 3}
    assert a.network == "loopback" and a.name == "x"


@pytest.mark.parametrize("argv", [
    ["--models", "alexnet"],
    ["--schemes", "ddp,nccl"],
    ["--schemes", "ddp,ddp"],
    ["--rates", "fast"],
    ["--rates", "1gb"],
    ["--ranks", "17"],
    ["--ranks", "0"],
    ["--iters", "0"],
    ["--rounds", "0"],
    ["--warmup", "-1"],
    ["--batch-sizes", "vgg=0"],
    ["--batch-sizes", "alexnet=4"],
    ["--network", "wifi"],
    ["--schemes", ""],
    ["--device", "tpu"],
])
def test_harness_rejects(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        harness.parse_args(argv)
    assert exc.value.code == 2


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="a machine with a GPU accepts --device cuda")
def test_harness_refuses_cuda_without_gpus(capsys):
    with pytest.raises(SystemExit) as exc:
        harness.parse_args(["--device", "cuda", "--ranks", "1", "--schemes", "compute,ddp"])
    assert exc.value.code == 2
    assert "one GPU per rank: 1 ranks, 0 GPU(s)" in capsys.readouterr().err


def test_harness_refuses_horovod_on_cuda(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(SystemExit) as exc:
        harness.parse_args(["--device", "cuda", "--ranks", "2", "--schemes", "ddp,hvd-dcredit"])
    assert exc.value.code == 2
    assert "['hvd-dcredit'] run on CPUs only" in capsys.readouterr().err


def test_scheme_list_is_frozen():
    # Adding a scheme means adding it to benchmarks/README.md and the results: do it on purpose.
    assert worker.SCHEMES == (
        "compute", "comm", "ddp", "horovod",
        "dc-wfbp", "dc-mgwfbp", "dc-oasr", "dc-bytescheduler", "dc-usbyte", "dc-dear", "dc-dcredit",
        "hvd-dcredit", "hvd-dcredit-ops",  # an unchanged Horovod script with our optimizer: C++ channels, Horovod ops
        "hvd-dcredit-ops-fused",  # Horovod ops with Horovod's tensor fusion left on
        "dc-dcredit-fp16",  # Compression.fp16
        "dc-dcredit-dense",  # Config(embedding_rows=False): embeddings all-reduced densely
        "dc-dcredit-eager",  # Config(lazy_step="off"): every update in step()
        "dc-dcredit-devwin",  # Config(device_windows=True): the credit window kept on the GPU
        "dc-deft",  # delayed updates, not synchronous training
    )


def test_every_dc_scheme_names_a_policy_and_a_known_variant():
    import dcredit_opt as dc
    from dcredit_opt.planner.plan import POLICY_NAMES

    for scheme in (s for s in worker.SCHEMES if s.startswith("dc-")):
        policy, variant = worker.dc_variant(scheme)
        assert policy in POLICY_NAMES and scheme == f"dc-{policy}{variant}", scheme
        accept = {"accept_delayed_updates": True} if policy == "deft" else {}  # as run_dc sets it
        dc.Config(policy=policy, **accept, **worker.DC_VARIANTS[variant]).validate()  # the overrides are fields


def test_worker_args():
    a = worker.parse_args(["--scheme", "dc-dear", "--model", "tiny", "--iters", "3"])
    assert (a.scheme, a.model, a.iters, a.warmup, a.threads, a.batch_size) == (
        "dc-dear", "tiny", 3, 2, 1, None)
    for bad in (["--scheme", "nope", "--model", "tiny", "--iters", "3"],
                ["--scheme", "ddp", "--model", "tiny", "--iters", "0"],
                ["--scheme", "ddp", "--model", "tiny"]):
        with pytest.raises(SystemExit):
            worker.parse_args(bad)


def test_models_registry():
    assert set(MODELS) == {"vgg", "resnet18", "gpt", "tiny"}
