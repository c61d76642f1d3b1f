"""The TOML config: defaults, overrides, validation messages, dump/load round trip."""
from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
import types

import pytest

from diffnet.problems import PROBLEMS, option_names
from deepfusion.config import files as config_files
from deepfusion.config import (
    Config,
    ConfigError,
    OptimConfig,
    apply_overrides,
    config_changes,
    config_from_dict,
    config_to_dict,
    describe,
    dump_toml,
    load_config,
)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = sorted(glob.glob(os.path.join(ROOT, "configs", "*.toml")))


def test_defaults():
    cfg = load_config(None)
    assert cfg == Config()
    assert cfg.problem.name == "" and cfg.problem.grid == [64, 64]  # required: set by the config
    assert cfg.problem.options == {} and cfg.model.options == {}
    assert cfg.model.name == "unet" and cfg.model.channels_last is True
    assert (cfg.data.n_samples, cfg.data.seed, cfg.data.global_batch) == (256, 0, 32)
    assert (cfg.data.eval_samples, cfg.data.eval_seed) == (16, 12345)
    assert (cfg.data.test_samples, cfg.data.test_seed) == (64, 271828)
    o = cfg.optim
    assert (o.name, o.lr, o.schedule, o.betas, o.momentum) == ("adam", 1e-3, "cosine",
                                                               [0.9, 0.999], 0.9)
    assert o.lbfgs_line_search == "strong_wolfe" and o.switch_to_lbfgs_epoch == -1
    t = cfg.train
    assert (t.epochs, t.max_steps, t.dtype, t.on_nonfinite, t.checksum_every) == (
        10, 0, "float32", "stop", 50)
    assert (t.checkpoint_every, t.checkpoint_minutes, t.keep_checkpoints) == (0, 10.0, 2)
    assert (t.rollback_lr_factor, t.rollback_min_lr_scale) == (0.5, 1e-3)
    assert not hasattr(t, "fail_at_step")  # test hooks live in DEEPFUSION_FAULT, not the config
    assert (cfg.parallel.threads_per_rank, cfg.parallel.overlap, cfg.parallel.bucket_mb) == (
        0, False, 4.0)
    assert cfg.parallel.max_useful_ranks == 0  # not stated: check gives the batches' limit
    assert (cfg.run.dir, cfg.run.progress) == ("runs/default", "auto")
    # mutable defaults are not shared between instances
    a, b = Config(), Config()
    a.problem.grid.append(3)
    assert b.problem.grid == [64, 64]


def test_every_section_is_kw_only_with_help():
    for f in dataclasses.fields(Config):
        cls = f.default_factory().__class__
        with pytest.raises(TypeError):
            cls(1)  # kw_only
        for sub in dataclasses.fields(cls):
            assert sub.metadata.get("help"), f"{f.name}.{sub.name} has no help text"


@pytest.mark.parametrize("override, check", [
    ("optim.lr=3e-4", lambda c: c.optim.lr == 3e-4),
    ("optim.lr=1", lambda c: c.optim.lr == 1.0 and type(c.optim.lr) is float),  # int -> float
    ("train.epochs=5", lambda c: c.train.epochs == 5),
    ("train.epochs=5.0", lambda c: c.train.epochs == 5 and type(c.train.epochs) is int),
    ("parallel.overlap=true", lambda c: c.parallel.overlap is True),
    ("parallel.max_useful_ranks=16", lambda c: c.parallel.max_useful_ranks == 16),
    ("optim.name=sgd", lambda c: c.optim.name == "sgd"),                  # bare string
    ('optim.name="lbfgs"', lambda c: c.optim.name == "lbfgs"),           # quoted string
    ('optim.name="lamb"', lambda c: c.optim.name == "lamb"),
    ("run.dir=runs/x y", lambda c: c.run.dir == "runs/x y"),
    ("problem.grid=[32, 48]", lambda c: c.problem.grid == [32, 48]),
    ("optim.betas=[0.8, 0.9]", lambda c: c.optim.betas == [0.8, 0.9]),
    ("problem.options.c_range=[2, 5]", lambda c: c.problem.options == {"c_range": [2, 5]}),
    ("model.options={depth = 3, base_width = 16}",
     lambda c: c.model.options == {"depth": 3, "base_width": 16}),
    (" train.log_every = 7 ", lambda c: c.train.log_every == 7),
])
def test_overrides_of_each_type(override, check):
    assert check(load_config(None, [override]))


def test_overrides_apply_over_file_and_in_order(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text('[optim]\nlr = 0.01\n[problem.options]\nc_range = [3, 6]\n')
    cfg = load_config(str(p), ["optim.lr=0.02", "optim.lr=0.03", "problem.options.bc_weight=2"])
    assert cfg.optim.lr == 0.03
    assert cfg.problem.options == {"c_range": [3, 6], "bc_weight": 2}
    raw = {"optim": {"lr": 1.0}}
    out = apply_overrides(raw, ["optim.lr=2"])
    assert out == {"optim": {"lr": 2}} and raw == {"optim": {"lr": 1.0}}  # input untouched


def _err(overrides, path=None) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value


def test_unknown_key_suggests_closest():
    e = _err(["optim.lrr=1"])
    assert str(e) == "unknown key 'optim.lrr'; did you mean 'optim.lr'?"
    assert e.key == "optim.lrr"
    assert "did you mean 'optim.lr'?" in str(_err(["train.lr=1"]))     # key in another section
    assert "did you mean 'optim'?" in str(_err(["optm.lr=1"]))         # misspelt section
    assert "did you mean 'optim.lr'?" in str(_err(["lr=1"]))           # section forgotten
    assert "did you mean 'train.epochs'?" in str(_err(["train.epoch=3"]))
    e = _err(["train.zzzzzz=1"])
    assert "valid keys in [train]:" in str(e) and "epochs" in str(e)


def test_wrong_type_messages():
    assert str(_err(["optim.lr=abc"])) == "optim.lr must be a float, got 'abc' (str)"
    e = _err(["train.epochs=2.5"])
    assert str(e) == "train.epochs must be an int, got 2.5 (float)" and e.key == "train.epochs"
    assert str(_err(["train.epochs=true"])) == "train.epochs must be an int, got True (bool)"
    assert "must be a float, got True (bool)" in str(_err(["optim.lr=true"]))
    assert "parallel.overlap must be a bool" in str(_err(["parallel.overlap=1"]))
    assert "optim.name must be a string" in str(_err(["optim.name=3"]))
    e = _err(["problem.grid=64"])
    assert "problem.grid must be a list of int" in str(e)
    e = _err(["problem.grid=[64, 6.5]"])
    assert "problem.grid[1] must be an int" in str(e) and e.key == "problem.grid"
    assert "problem.options must be a table" in str(_err(["problem.options=3"]))
    assert "optim.lr must be a finite float, got nan" in str(_err(["optim.lr=nan"]))
    with pytest.raises(ConfigError, match="optim.lr must be a float"):
        OptimConfig(lr="0.1")  # the same checks for configs built in Python


@pytest.mark.parametrize("override, expect", [
    ("optim.lr=0", "optim.lr must be > 0.0, got 0.0"),
    ("optim.lr=-1", "optim.lr must be > 0.0"),
    ("problem.grid=[3, 64]", "problem.grid[0] must be >= 4, got 3"),
    ("problem.grid=[]", "problem.grid must have 1 to 3 entries"),
    ("data.global_batch=0", "data.global_batch must be >= 1"),
    ("data.n_samples=8", "data.n_samples must be >= data.global_batch (32), got 8"),
    ("data.eval_seed=0", "data.eval_seed must differ from data.seed"),
    ("optim.betas=[0.9]", "optim.betas must have exactly 2 entries"),
    ("optim.betas=[0.9, 1.0]", "optim.betas[1] must be in [0, 1)"),
    ("optim.momentum=1.0", "optim.momentum must be < 1.0"),
    ("optim.gamma=0", "optim.gamma must be > 0.0"),
    ("optim.min_lr=0.1", "optim.min_lr must be <= optim.lr"),
    ("train.keep_checkpoints=0", "train.keep_checkpoints must be >= 1"),
    ("train.rollback_lr_factor=1.0", "train.rollback_lr_factor must be < 1.0"),
    ("train.checkpoint_minutes=-1", "train.checkpoint_minutes must be >= 0.0"),
    ("train.time_limit_minutes=-1", "train.time_limit_minutes must be >= 0.0"),
    ("data.test_seed=12345", "data.test_seed must differ from data.seed (0) and data.eval_seed"),
    ("train.fail_at_step=3", "unknown key 'train.fail_at_step'"),
    ("parallel.bucket_mb=0", "parallel.bucket_mb must be > 0.0"),
    ("parallel.max_useful_ranks=-1", "parallel.max_useful_ranks must be >= 0, got -1"),
    ("parallel.max_useful_ranks=2.5", "parallel.max_useful_ranks must be an int"),
    ("optim.switch_to_lbfgs_epoch=10", "optim.switch_to_lbfgs_epoch must be < train.epochs"),
    ("problem.options.grid=[8, 8]", "problem.options.grid is not allowed: set problem.grid"),
    ("run.dir=", "run.dir must be a non-empty directory path"),
])
def test_out_of_range(override, expect):
    assert expect in str(_err([override]))


def test_lbfgs_switch_needs_first_order_optimizer():
    cfg = load_config(None, ["optim.switch_to_lbfgs_epoch=3"])
    assert cfg.optim.switch_to_lbfgs_epoch == 3
    e = _err(["optim.name=lbfgs", "optim.switch_to_lbfgs_epoch=3"])
    assert e.key == "optim.switch_to_lbfgs_epoch" and "set it to -1" in str(e)


def test_bad_choice_lists_valid_choices():
    e = _err(["optim.name=adamw"])
    assert "optim.name must be one of 'adam', 'sgd', 'lamb', 'lbfgs'; got 'adamw'" in str(e)
    assert "did you mean 'adam'?" in str(e)
    assert "'constant', 'cosine', 'step', 'exponential'" in str(_err(["optim.schedule=linear"]))
    assert "'float32', 'float64'" in str(_err(["train.dtype=float16"]))
    assert "'stop', 'rollback'" in str(_err(["train.on_nonfinite=ignore"]))
    assert "'auto', 'bar', 'log'" in str(_err(["run.progress=tqdm"]))
    assert "'strong_wolfe', 'none'" in str(_err(["optim.lbfgs_line_search=armijo"]))


def test_malformed_override():
    e = _err(["optim.lr"])
    assert "malformed override 'optim.lr'" in str(e) and "key=value" in str(e)
    assert "key=value" in str(_err(["=3"]))
    assert "key=value" in str(_err(["optim..lr=3"]))
    e = _err(["optim.lr.x=1"])  # into a non-table
    assert e.key == "optim.lr"
    with pytest.raises(ConfigError, match="'optim.lr' is a value, not a table"):
        apply_overrides({"optim": {"lr": 1.0}}, ["optim.lr.x=1"])


def test_newline_in_override_value_is_not_a_second_key():
    cfg = load_config(None, ["run.dir=a\nb = 1"])
    assert cfg.run.dir == "a\nb = 1"


def test_missing_file_and_bad_toml(tmp_path):
    e = _err([], str(tmp_path / "nope.toml"))
    assert str(e) == f"config file not found: {tmp_path / 'nope.toml'}"
    bad = tmp_path / "bad.toml"
    bad.write_text("[optim]\nlr = 0.1\nname = adam\n")
    e = _err([], str(bad))
    assert str(bad) in str(e) and "invalid TOML" in str(e) and "line 3" in str(e)
    dup = tmp_path / "dup.toml"
    dup.write_text("[optim]\nlr = 0.1\nlr = 0.2\n")
    assert "line 3" in str(_err([], str(dup)))


def test_errors_from_a_file_name_the_file(tmp_path):
    p = tmp_path / "c.toml"
    p.write_text("[optim]\nlrr = 0.1\n")
    e = _err([], str(p))
    assert "did you mean 'optim.lr'?" in str(e) and str(p) in str(e)
    p.write_text("optim = 3\n")
    assert "optim must be a table" in str(_err([], str(p)))
    p.write_text("[optim]\nlr = 0.1\n")
    e = _err(["optim.lr=x"], str(p))  # an override's fault: no file blamed
    assert str(p) not in str(e)


def test_dump_toml_round_trip(tmp_path):
    cfg = load_config(None, [
        "problem.name=poisson", "problem.grid=[32, 48]",
        'problem.options={omega_range = [-3, 3.5], loss = "energy", "odd key" = {a = [1, "x"]}}',
        "optim.lr=1.5e-05", "optim.min_lr=1e-7", "optim.betas=[0.8, 0.95]", "train.dtype=float64",
        'run.dir=runs/quote "dir" \\ back', "parallel.overlap=true", "parallel.bucket_mb=0.25",
    ])
    text = dump_toml(cfg)
    p = tmp_path / "resolved.toml"
    p.write_text(text)
    again = load_config(str(p))
    assert again == cfg
    assert config_to_dict(again) == config_to_dict(cfg)
    assert dump_toml(again) == text
    # the default config too
    p.write_text(dump_toml(Config()))
    assert load_config(str(p)) == Config()


def test_config_to_dict_is_plain_json():
    cfg = load_config(None, ["problem.options.c_range=[3, 6]"])
    d = config_to_dict(cfg)
    assert json.loads(json.dumps(d)) == d
    assert config_from_dict(d) == cfg
    d["optim"]["lr"] = 5.0  # a copy, not a view
    assert cfg.optim.lr == 1e-3


def test_describe_lists_every_key_with_type_default_and_help():
    text = describe()
    for s in dataclasses.fields(Config):
        for f in dataclasses.fields(f_cls := s.default_factory().__class__):
            assert f"{s.name}.{f.name}:" in text, (f_cls, f.name)
    assert "optim.lr: float = 0.001" in text
    assert "optim.name: string = \"adam\"" in text and "one of 'adam', 'sgd', 'lamb', 'lbfgs'" in text
    assert "problem.grid: list[int] = [64, 64]" in text and "each entry >= 4" in text
    assert "peak learning rate" in text


def test_tomli_fallback_path_on_python_310(monkeypatch):
    fake = types.ModuleType("tomli")
    monkeypatch.setitem(sys.modules, "tomli", fake)
    assert config_files.import_toml((3, 10, 0)) is fake
    if sys.version_info >= (3, 11):
        import tomllib

        assert config_files.import_toml((3, 11, 0)) is tomllib
    src = open(config_files.__file__).read()
    assert "import tomli" in src and "import tomllib" in src


@pytest.mark.parametrize("path", CONFIGS, ids=[os.path.basename(p) for p in CONFIGS])
def test_example_configs_load(path):
    cfg = load_config(path)
    assert dump_toml(cfg)
    assert cfg.problem.name in PROBLEMS
    bad = set(cfg.problem.options) - set(option_names(cfg.problem.name))
    assert not bad, f"{path}: options {bad} unknown to problem {cfg.problem.name!r}"


def test_expected_example_configs_exist():
    names = {os.path.basename(p) for p in CONFIGS}
    assert {"burgers.toml", "poisson.toml", "reaction_diffusion.toml", "demo.toml"} <= names
    demo = load_config(os.path.join(ROOT, "configs", "demo.toml"))
    assert (demo.problem.name, demo.problem.grid) == ("burgers", [64, 64])
    assert (demo.data.global_batch, demo.data.n_samples) == (16, 1024)
    burgers = load_config(os.path.join(ROOT, "configs", "burgers.toml"))
    assert burgers.problem.options["c_range"] == [3.0, 6.0]


def test_overrides_index_arrays_of_tables():
    raw = {"train": {"levels": [{"grid": [16, 16], "steps": 5}, {"grid": [32, 32], "steps": 1}]}}
    out = apply_overrides(raw, ["train.levels[1].steps=40", "train.levels[0]={grid=[8,8],steps=1}"])
    assert out["train"]["levels"] == [{"grid": [8, 8], "steps": 1}, {"grid": [32, 32], "steps": 40}]
    assert raw["train"]["levels"][1]["steps"] == 1  # a copy
    with pytest.raises(ConfigError, match=r"the array has 2 entries \(indices 0..1\)"):
        apply_overrides(raw, ["train.levels[2].steps=1"])
    with pytest.raises(ConfigError, match="'train' is a value, not an array"):
        apply_overrides({"train": 1}, ["train[0].x=1"])


def test_config_changes_name_each_differing_leaf():
    old = config_to_dict(load_config(None, ["train.levels=[{grid=[8,8],steps=1},"
                                            "{grid=[16,16],steps=2,prolong=true}]",
                                            "problem.grid=[16,16]"]))
    new = config_to_dict(load_config(None, ["train.levels=[{grid=[8,8],steps=1},"
                                            "{grid=[16,16],steps=2,prolong=true,"
                                            "train_inner=false}]", "problem.grid=[16,16]",
                                            "optim.lr=5e-4"]))
    assert config_changes(old, old) == []
    assert config_changes(old, new) == [
        f"optim.lr: {old['optim']['lr']!r} -> 0.0005",
        "train.levels[1].train_inner: (unset) -> False"]
    old["train"]["levels"].pop()  # a level added: the array is shown whole
    assert config_changes(old, new)[1].startswith("train.levels: [{'grid': [8, 8]")
