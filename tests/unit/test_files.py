"""Note [Whole files] (dcredit_opt/files.py): a reader sees the old file or the new one, never a part."""

import json
import os
import stat
import threading
import time

import pytest
import torch
from torch import nn

import dcredit_opt as dc
from dcredit_opt import files

pytestmark = pytest.mark.timeout(120)


def _leftovers(folder):
    return sorted(p for p in os.listdir(folder) if p.startswith("."))


def test_write_whole_replaces_the_file_and_leaves_nothing_beside_it(tmp_path):
    path = tmp_path / "plan.json"
    files.write_whole(path, "x" * 10_000)
    files.write_whole(path, b"short")  # shorter than before: nothing of the old content remains
    assert path.read_bytes() == b"short"
    assert _leftovers(tmp_path) == []
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask  # as open(path, "w") makes it


def test_write_whole_into_a_missing_folder_fails_and_changes_nothing(tmp_path):
    with pytest.raises(OSError):
        files.write_whole(tmp_path / "missing" / "f.json", "{}")
    with pytest.raises(IsADirectoryError):
        files.write_whole(tmp_path, "{}")  # the path is a folder: refused by the rename, the folder untouched
    assert os.listdir(tmp_path) == []


def test_an_appended_file_is_published_whole_at_each_flush(tmp_path):
    path = tmp_path / "t.json"
    f = files.AppendedWhole(path)
    assert path.read_bytes() == b""  # the path exists from the start, as with open(path, "wb")
    f.write(b'{"a": [1')
    assert path.read_bytes() == b""  # not flushed: not published
    f.write(b"]}")
    f.flush()
    assert json.loads(path.read_text()) == {"a": [1]}
    f.seek(8)  # over the closing "]}"
    f.write(b", 2]}")
    f.close()
    f.close()
    assert json.loads(path.read_text()) == {"a": [1, 2]}
    assert _leftovers(tmp_path) == []  # the working file and every temporary one are gone


def test_a_flush_with_nothing_new_publishes_nothing(tmp_path):
    """A writer closed late (a timeline dropped by stop_timeline() and collected later) must not bring back
    a file its user has removed, nor copy the whole file again for nothing."""
    path = tmp_path / "t.json"
    f = files.AppendedWhole(path)
    f.write(b"{}")
    f.flush()
    path.unlink()
    f.flush()
    f.close()
    assert not path.exists()
    assert _leftovers(tmp_path) == []


def test_a_reader_never_sees_a_partial_timeline_while_training_writes_it(tmp_path):
    """The timeline is rewritten after every iteration; another thread reading it all the while always gets
    valid JSON (before, a read during a rewrite could get a whole JSON followed by the rest of an older one)."""
    path = tmp_path / "trace.json"
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = dc.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  named_parameters=model.named_parameters(),
                                  config=dc.Config(block_bytes=64, window=2, policy="fixed",
                                                   timeline_path=str(path)))
    stop, started, reads, bad = threading.Event(), threading.Event(), [], []

    def reader():
        while not stop.is_set():
            started.set()
            text = path.read_text() if path.exists() else ""
            if text:
                try:
                    reads.append(len(json.loads(text)["traceEvents"]))
                except json.JSONDecodeError as e:
                    bad.append(f"{e}: {text[-80:]!r}")
            time.sleep(0.0005)  # leaves the GIL to training most of the time

    thread = threading.Thread(target=reader)
    thread.start()
    started.wait(30)
    try:
        for _ in range(60):
            opt.zero_grad()
            model(torch.randn(3, 4)).pow(2).sum().backward()
            opt.step()
            time.sleep(0.002)  # the reader gets the GIL between steps on a busy machine too
    finally:
        stop.set()
        thread.join(30)
        opt._dc.close()
    assert not bad, f"{len(bad)} partial reads, the first: {bad[0]}"
    assert len(set(reads)) > 1, f"the reader should have seen the file grow: {len(reads)} reads"
    assert json.loads(path.read_text())["traceEvents"]
    assert [p for p in _leftovers(tmp_path)] == []
