"""``dcredit_opt.Config``: its frozen field list, validation naming the field,
and ``DCREDIT_*`` environment overrides (read through ``from_env(environ=...)``,
so no test touches the real environment except through monkeypatch)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import logging
import math
import textwrap
from pathlib import Path

import pytest

import dcredit_opt
from dcredit_opt import Config
from dcredit_opt.config import field_docs, reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"

# The field list, frozen (torchtitan does the same for its options): adding,
# removing, renaming or retyping a field must change this test too, so the
# change is deliberate and the docs and env variables follow it.
FIELDS = (
    ("policy", "str"),
    ("backend", "str"),
    ("block_bytes", "int"),
    ("window", "int"),
    ("credit_bytes", "int"),
    ("channels", "int"),
    ("overlap_forward", "bool"),
    ("device_windows", "bool"),
    ("lazy_step", "str"),
    ("profile_iters", "int"),
    ("collective_host_s", "float"),
    ("replan_every", "int"),
    ("replan_threshold", "float"),
    ("timeout_s", "float"),
    ("timeline_path", "str | None"),
    ("embedding_rows", "bool"),
    ("accept_delayed_updates", "bool"),
    ("check_finite", "bool"),
    ("check_weights_every", "int"),
)


@pytest.mark.timeout(60)
def test_field_list_is_frozen():
    assert tuple((f.name, f.type) for f in dataclasses.fields(Config)) == FIELDS
    assert dcredit_opt.Config is Config


@pytest.mark.timeout(60)
def test_deft_needs_the_acknowledgement_and_nothing_else_takes_it():
    """Note [Delayed updates]: the one policy that does not train like synchronous data parallelism runs only
    when the user says they accept it, and the acknowledgement means nothing elsewhere."""
    with pytest.raises(ValueError, match=r"Config.policy 'deft' updates some parameters with the previous "
                                         r"iteration's gradients.*accept_delayed_updates=True"):
        Config(policy="deft")
    with pytest.raises(ValueError, match=r"accept_delayed_updates=True is only for policy 'deft'; policy 'dcredit'"):
        Config(accept_delayed_updates=True)
    assert Config(policy="deft", accept_delayed_updates=True).policy == "deft"
    with pytest.raises(ValueError, match="DCREDIT_POLICY='deft'"):
        Config.from_env({"DCREDIT_POLICY": "deft"})
    assert Config.from_env({"DCREDIT_POLICY": "deft", "DCREDIT_ACCEPT_DELAYED_UPDATES": "1"}).accept_delayed_updates


@pytest.mark.timeout(60)
def test_every_field_has_a_default_and_a_docstring():
    Config()  # the defaults are valid
    assert all(f.default is not dataclasses.MISSING for f in dataclasses.fields(Config))
    # STYLE: one docstring per field, the string right after its annotation.
    body = ast.parse(textwrap.dedent(inspect.getsource(Config))).body[0].body
    documented = {stmt.target.id for stmt, after in itertools.pairwise(body)
                  if isinstance(stmt, ast.AnnAssign) and isinstance(after, ast.Expr)
                  and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}
    assert documented == {name for name, _ in FIELDS}


@pytest.mark.timeout(60)
def test_the_configuration_doc_is_generated_and_current():
    """docs/configuration.md is ``python -m dcredit_opt config``'s output, so it cannot drift from the fields."""
    assert DOC.read_text() == reference_markdown(), (
        "docs/configuration.md is stale: run `python -m dcredit_opt config > docs/configuration.md`")
    docs = field_docs()
    assert list(docs) == [name for name, _ in FIELDS]
    text = DOC.read_text()
    for name, kind in FIELDS:  # every field, its variable and its whole docstring
        section = text.split(f"\n## {name}\n", 1)[1].split("\n## ", 1)[0]
        assert f"`{kind}`" in section and f"`DCREDIT_{name.upper()}`" in section and docs[name] in section, name


@pytest.mark.parametrize(("field", "value"), [
    ("policy", "fastest"),
    ("policy", ""),
    ("backend", "nccl"),
    ("block_bytes", 0),
    ("block_bytes", -4096),
    ("block_bytes", 4.5),
    ("block_bytes", "4096"),
    ("window", 0),
    ("window", -2),
    ("window", 2.0),
    ("credit_bytes", -1),
    ("credit_bytes", 1.5),
    ("channels", 0),
    ("channels", 65),
    ("channels", 2.0),
    ("profile_iters", -1),
    ("profile_iters", 0.5),
    ("replan_every", -1),
    ("replan_every", 1),
    ("replan_every", 2.0),
    ("check_weights_every", -1),
    ("check_weights_every", 1.5),
    ("check_weights_every", True),
    ("replan_threshold", -0.1),
    ("replan_threshold", math.nan),
    ("replan_threshold", "0.1"),
    ("timeout_s", 0),
    ("timeout_s", -1.0),
    ("timeout_s", math.nan),
    ("timeout_s", "30"),
    ("collective_host_s", -1e-6),
    ("collective_host_s", math.nan),
    ("collective_host_s", math.inf),
    ("collective_host_s", 2.0),
    ("collective_host_s", True),
    ("collective_host_s", "2e-5"),
])
@pytest.mark.timeout(60)
def test_bad_value_raises_naming_the_field(field, value):
    with pytest.raises(ValueError, match=rf"Config\.{field}\b"):
        Config(**{field: value})
    # validate() catches the same value set after construction.
    config = Config()
    setattr(config, field, value)
    with pytest.raises(ValueError, match=rf"Config\.{field}\b"):
        config.validate()


@pytest.mark.parametrize(("field", "value"), [
    ("window", -1),  # -1 = release every ready block
    ("window", 1),
    ("credit_bytes", 0),  # 0 = no byte limit
    ("channels", 1),
    ("channels", 64),
    ("profile_iters", 0),
    ("timeout_s", 1),  # an int number of seconds is fine
    ("timeout_s", 0.001),
    ("collective_host_s", 0),  # plans for the link alone
    ("collective_host_s", 5e-5),
    ("policy", "fixed"),
    ("backend", "mpi"),
])
@pytest.mark.timeout(60)
def test_edge_values_are_accepted(field, value):
    assert getattr(Config(**{field: value}), field) == value


# ---- environment overrides -------------------------------------------------


@pytest.mark.timeout(60)
def test_env_overrides_every_field_type():
    config = Config.from_env(environ={
        "DCREDIT_POLICY": "ddp",
        "DCREDIT_BLOCK_BYTES": " 65536 ",
        "DCREDIT_WINDOW": "-1",
        "DCREDIT_TIMEOUT_S": "2.5e0",
        "DCREDIT_OVERLAP_FORWARD": "off",
        "DCREDIT_CHECK_FINITE": "Yes",
        "DCREDIT_TIMELINE_PATH": "/tmp/timeline.json",
        "OTHER_VARIABLE": "ignored",
    })
    assert (config.policy, config.block_bytes, config.window, config.timeout_s) == ("ddp", 65536, -1, 2.5)
    assert (config.overlap_forward, config.check_finite) == (False, True)
    assert config.timeline_path == "/tmp/timeline.json"
    assert Config.from_env(environ={}) == Config()


@pytest.mark.parametrize(("raw", "value"), [
    ("1", True), ("true", True), ("TRUE", True), ("yes", True), (" on ", True),
    ("0", False), ("false", False), ("No", False), ("off", False),
])
@pytest.mark.timeout(60)
def test_env_bool_spellings(raw, value):
    assert Config.from_env(environ={"DCREDIT_CHECK_FINITE": raw}).check_finite is value


@pytest.mark.parametrize(("var", "raw"), [
    ("DCREDIT_CHECK_FINITE", "maybe"),
    ("DCREDIT_OVERLAP_FORWARD", ""),
    ("DCREDIT_BLOCK_BYTES", "4MiB"),
    ("DCREDIT_BLOCK_BYTES", "4096.0"),
    ("DCREDIT_CHANNELS", ""),
    ("DCREDIT_TIMEOUT_S", "thirty"),
])
@pytest.mark.timeout(60)
def test_env_unparsable_value_names_the_variable(var, raw):
    with pytest.raises(ValueError, match=var):
        Config.from_env(environ={var: raw})


@pytest.mark.parametrize(("var", "raw", "field"), [
    ("DCREDIT_WINDOW", "0", "window"),
    ("DCREDIT_CHANNELS", "100", "channels"),
    ("DCREDIT_TIMEOUT_S", "-1", "timeout_s"),
    ("DCREDIT_POLICY", "fastest", "policy"),
])
@pytest.mark.timeout(60)
def test_env_value_that_parses_but_is_invalid_names_the_field(var, raw, field):
    with pytest.raises(ValueError, match=rf"Config\.{field}\b"):
        Config.from_env(environ={var: raw})


@pytest.mark.timeout(60)
def test_explicit_overrides_beat_the_environment():
    config = Config.from_env(environ={"DCREDIT_WINDOW": "4", "DCREDIT_CHANNELS": "3"}, window=8)
    assert (config.window, config.channels) == (8, 3)


@pytest.mark.timeout(60)
def test_timeline_path_empty_means_none():
    assert Config.from_env(environ={"DCREDIT_TIMELINE_PATH": ""}).timeline_path is None


@pytest.mark.timeout(60)
def test_unknown_dcredit_variable_warns_naming_the_known_ones(caplog):
    with caplog.at_level(logging.WARNING, logger="dcredit_opt"):
        config = Config.from_env(environ={"DCREDIT_WINDOWS": "4", "DCREDIT_CHANNELS": "3"})
    assert config.window == Config().window and config.channels == 3  # the typo changed nothing
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "DCREDIT_WINDOWS" in warnings[0]
    for name, _ in FIELDS:
        assert f"DCREDIT_{name.upper()}" in warnings[0]


@pytest.mark.timeout(60)
def test_no_warning_for_known_variables(caplog):
    with caplog.at_level(logging.WARNING, logger="dcredit_opt"):
        Config.from_env(environ={f"DCREDIT_{name.upper()}": "1" for name in ("window", "channels", "check_finite")})
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


@pytest.mark.timeout(60)
def test_from_env_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("DCREDIT_CHANNELS", "5")
    assert Config.from_env().channels == 5


@pytest.mark.timeout(60)
@pytest.mark.parametrize("field, value", [("block_bytes", True), ("window", False), ("overlap_forward", "no"),
                                          ("check_finite", 3), ("embedding_rows", "yes"), ("timeline_path", 5),
                                          ("timeout_s", True), ("replan_every", True), ("replan_threshold", False)])
def test_wrong_types_are_refused(field, value):
    with pytest.raises(ValueError, match=f"Config.{field}"):
        Config(**{field: value})
