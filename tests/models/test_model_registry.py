"""The model registry: specs as names, dicts or JSON; loud, specific errors."""

from __future__ import annotations

import json
from types import SimpleNamespace
from typing import Any

import pytest

from models import (
    AdaptiveTreeResidual,
    ModelSpec,
    ModelSpecError,
    ScaledLinearResidual,
    ZeroResidual,
    make_model,
    model_kinds,
    parse_spec,
    register_model,
)
from models import registry as registry_module


def test_builtin_kinds() -> None:
    assert {"ewmean", "linear", "ratio", "tree", "none"} <= set(model_kinds())
    assert model_kinds() == sorted(model_kinds())


def test_unknown_kind_lists_the_known_ones() -> None:
    with pytest.raises(ModelSpecError, match="unknown model kind 'nope'; known: ") as info:
        make_model("nope")
    assert "ewmean, linear, none, ratio, tree" in str(info.value)


def test_bad_param_names_list_the_accepted_ones() -> None:
    with pytest.raises(ModelSpecError) as info:
        make_model({"kind": "linear", "params": {"learning_rate": 0.1, "lr": 0.1}})
    text = str(info.value)
    assert "model kind 'linear' has no parameter(s) ['learning_rate']" in text
    for name in ("clip_gradient", "intercept_lr", "l2", "lr", "target_scale_ms"):
        assert name in text.split("accepted:")[1]


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"kind": "linear", "params": {"lr": -1.0}}, "lr must be > 0"),
        ({"kind": "tree", "params": {"max_depth": 0}}, "max_depth must be >= 1"),
        ({"kind": "tree", "params": {"target_scale_ms": 0}}, "target_scale_ms must be > 0"),
    ],
)
def test_bad_param_values_say_what_was_wrong(spec: dict[str, Any], needle: str) -> None:
    with pytest.raises(ModelSpecError, match=f"bad params for model kind '{spec['kind']}'") as info:
        make_model(spec)
    assert needle in str(info.value)


def test_specs_as_name_dict_json_and_spec_agree() -> None:
    as_dict = {"kind": "tree", "params": {"max_depth": 3, "grace_period": 20}}
    forms = [as_dict, json.dumps(as_dict), "  " + json.dumps(as_dict) + "\n", ModelSpec(**as_dict)]
    parsed = [parse_spec(f) for f in forms]
    assert all(p == parsed[0] for p in parsed)
    assert parsed[0].to_dict() == as_dict
    model = make_model(json.dumps(as_dict))
    assert isinstance(model, AdaptiveTreeResidual)
    assert (model.max_depth, model.grace_period) == (3, 20)
    assert parse_spec("linear") == ModelSpec("linear")
    assert isinstance(make_model(" linear "), ScaledLinearResidual)
    assert isinstance(make_model('{"kind": "none"}'), ZeroResidual)


def test_spec_key_is_canonical() -> None:
    a = parse_spec('{"kind": "linear", "params": {"lr": 0.1, "l2": 0.0}}')
    b = parse_spec({"params": {"l2": 0.0, "lr": 0.1}, "kind": "linear"})
    assert a.key == b.key
    assert a.key != parse_spec({"kind": "linear", "params": {"lr": 0.2, "l2": 0.0}}).key


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ('{"kind": "linear",', "not valid JSON"),
        ('{"kind": "linear", "parms": {}}', "unknown keys ['parms']"),
        ({"params": {}}, "needs a string 'kind'"),
        ({"kind": 3}, "needs a string 'kind'"),
        ({"kind": ""}, "needs a string 'kind'"),
        ({"kind": "linear", "params": [1, 2]}, "'params' must be an object"),
        ('{"kind": "linear", "params": 5}', "'params' must be an object"),
        (42, "must be a kind name or an object"),
        (["linear"], "must be a kind name or an object"),
    ],
)
def test_parse_errors_are_model_spec_errors(spec: Any, needle: str) -> None:
    with pytest.raises(ModelSpecError) as info:
        parse_spec(spec)
    assert needle in str(info.value)
    assert isinstance(info.value, ValueError)  # callers that catch ValueError still work


def test_blank_and_duplicate_registration_refused() -> None:
    model_kinds()  # built-ins loaded before the copy
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(
            registry_module.REGISTRY, "_factories", dict(registry_module.REGISTRY._factories)
        )
        for blank in ("", "   "):
            with pytest.raises(ValueError, match="must not be blank"):
                register_model(blank, ZeroResidual)
        with pytest.raises(ValueError, match="'ewmean' is already registered"):
            register_model("ewmean", ZeroResidual)
        register_model("zero2", ZeroResidual)
        assert "zero2" in model_kinds()
        assert isinstance(make_model("zero2"), ZeroResidual)
    assert "zero2" not in model_kinds()


def _fresh(monkeypatch: pytest.MonkeyPatch, entry_points: Any) -> None:
    """The model registry as at start-up (nothing loaded), with these entry points."""
    import kvroute.registry

    monkeypatch.setattr(registry_module.REGISTRY, "_factories", {})
    monkeypatch.setattr(registry_module.REGISTRY, "_loaded", False)
    monkeypatch.setattr(kvroute.registry, "entry_points", entry_points)


def test_registering_first_does_not_hide_the_builtins(monkeypatch: pytest.MonkeyPatch) -> None:
    """A third party that registers before the first lookup still gets the built-ins."""
    _fresh(monkeypatch, lambda group: [])
    register_model("mine", ZeroResidual)
    assert {"ewmean", "linear", "mine", "none", "tree"} <= set(model_kinds())


def test_entry_points_add_kinds(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[str] = []

    def entry_points(group: str) -> list[SimpleNamespace]:
        seen.append(group)
        return [
            SimpleNamespace(name="plugged", load=lambda: ZeroResidual),
            SimpleNamespace(name="ewmean", load=lambda: ZeroResidual),  # built-in wins
        ]

    _fresh(monkeypatch, entry_points)
    assert "plugged" in model_kinds()
    assert seen == ["kvroute.models"]
    assert isinstance(make_model("plugged"), ZeroResidual)
    assert not isinstance(make_model("ewmean"), ZeroResidual)
