"""benchmarks/host_patterns.py: each pattern trains the same way plain and ours (what it times is like for like)."""

import warnings

import pytest
import torch

from benchmarks import host_patterns

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("pattern", list(host_patterns.PATTERNS))
def test_each_pattern_trains_as_plain_torch_does(pattern):
    warnings.filterwarnings("ignore", message="GradScaler is going to stop passing itself")
    plain, ours = host_patterns.Setup(pattern, "plain"), host_patterns.Setup(pattern, "dc")
    try:
        for s in (plain, ours):
            s.turn(8)  # lazy steps from the second or third on; ours synchronized at the end: nothing pending
        for (name, p), q in zip(ours.model.named_parameters(), plain.model.parameters()):
            assert torch.allclose(p.detach(), q.detach(), atol=1e-5), f"{pattern}: {name} differs from plain torch"
    finally:
        for o in ours.opts:
            o._dc.close()


def test_an_unknown_pattern_is_refused_by_name(capsys):
    with pytest.raises(SystemExit):
        host_patterns.main(["--patterns", "plain,nonsense"])
    assert "nonsense" in capsys.readouterr().err
