"""Stack validation: every malformed YAML gets a message naming its key path, the allowed values and the value."""

import dataclasses
import re

import pytest

import kvcompress
from kvcompress import CompressorSpec, ConfigError, Layout, hookimpl, param
from kvcompress.registry import Registry
from kvcompress.stack import load_stack, parse_stack, read_yaml

BAD = [
    # (yaml text, expected path, expected fragment of the message)
    ("", "(top level)", "a mapping with a 'compressors' list"),
    ("- window: {}", "(top level)", "a mapping"),
    ("name: x", "compressors", "the key is missing"),
    ("compressors: {window: {}}", "compressors", "a list of one-key mappings"),
    ("compressors: [window]", "compressors[0]", "one-key mapping"),
    ("compressors:\n  - {window: {}, extra: {}}", "compressors[0]", "one-key mapping"),
    ("compressors:\n  - windw: {recent: 8}", "compressors[0].windw", "a registered compressor: double_sparse, expected_attention, keydiff, kivi, knorm, leank, lowrank, paged_eviction, snapkv, tova, window"),
    ("compressors:\n  - window: {recent: -1}", "compressors[0].window.recent", "an integer in [1, 16777216]"),
    ("compressors:\n  - window: {recent: 0}", "compressors[0].window.recent", "got 0"),
    ("compressors:\n  - window: {recent: 1.5}", "compressors[0].window.recent", "got 1.5"),
    ("compressors:\n  - window: {recent: true}", "compressors[0].window.recent", "got True"),
    ("compressors:\n  - window: {recent: '64'}", "compressors[0].window.recent", "got '64'"),
    ("compressors:\n  - window: {sinks: null}", "compressors[0].window.sinks", "got None"),
    ("compressors:\n  - window: {size: 3}", "compressors[0].window.size", "known parameters: recent, sinks"),
    ("compressors:\n  - window: [4, 8]", "compressors[0].window", "a mapping of parameters"),
    ("compressors: []\nbudget: 3", "budget", "top-level keys: compressors, name, description"),
    ("compressors: []\nname: [a]", "name", "a string"),
    ("compressors:\n  - window: {}\n  - window: {}", "compressors[1].window", "at most one compressor on the token eviction axis"),
    ("compressors:\n  - window: {recent: 8, recent: 9}", "<t>", "duplicate key 'recent'"),
    ("compressors: [\n", "<t>", "valid YAML"),
    ("!!python/object/apply:os.system ['true']", "<t>", "valid YAML"),
]


@pytest.mark.parametrize("text,path,fragment", BAD)
def test_malformed_stack_names_path_allowed_and_given(tmp_path, text, path, fragment):
    f = tmp_path / "t.yaml"
    f.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_stack(f)
    err = info.value
    expected_path = str(f) if path == "<t>" else path
    assert err.path == expected_path
    assert fragment in str(err)
    assert "expected" in str(err) and "got" in str(err)


def test_unknown_compressor_lists_registered_ones():
    with pytest.raises(ConfigError) as info:
        parse_stack({"compressors": [{"nope": {}}]})
    assert "window" in info.value.allowed
    assert "kvcompress plugins" in str(info.value)


def test_safe_loader_never_builds_python_objects(tmp_path):
    marker = tmp_path / "pwned"
    f = tmp_path / "evil.yaml"
    f.write_text(f"compressors: !!python/object/apply:os.system ['touch {marker}']\n")
    with pytest.raises(ConfigError):
        load_stack(f)
    assert not marker.exists()


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="readable YAML stack file"):
        load_stack(tmp_path / "missing.yaml")


def test_valid_stack_round_trips():
    stack = parse_stack({"name": "w", "compressors": [{"window": {"recent": 64}}]})
    assert stack.to_dict() == {"name": "w", "compressors": [{"window": {"sinks": 4, "recent": 64}}]}
    assert parse_stack(stack.to_dict()).to_dict() == stack.to_dict()
    assert stack.label == "w"


def test_example_stacks_are_valid():
    from pathlib import Path

    files = sorted((Path(__file__).parents[1] / "examples" / "stacks").glob("*.yaml"))
    assert {f.name for f in files} >= {"none.yaml", "window.yaml"}
    for f in files:
        load_stack(f)


# ---- order and exclusive axes, with test compressors on every axis -------------------------------


@dataclasses.dataclass(frozen=True)
class _Cfg:
    level: int = param(1, "test parameter", min=0)


class _Obj(kvcompress.Compressor):
    @hookimpl
    def kvcompress_layer_layout(self, layer):
        return Layout()


def _registry():
    reg = Registry()
    for name, axis in [("ev", "evict"), ("ev2", "evict"), ("pr", "prune"), ("lr", "lowrank"), ("rg", "regroup"),
                       ("qu", "quantize"), ("se", "select")]:
        reg.add(CompressorSpec(name=name, axis=axis, config=_Cfg, factory=_Obj), "test")
    return reg


@pytest.mark.parametrize("names", [["ev", "pr", "rg", "qu"], ["se", "lr", "qu"], ["ev", "se", "qu"], ["qu"], []])
def test_orders_that_follow_the_pipeline_are_accepted(names):
    parse_stack({"compressors": [{n: {}} for n in names]}, registry=_registry())


@pytest.mark.parametrize("names,bad_index,first,second", [
    (["qu", "ev"], 1, "ev", "qu"),
    (["rg", "pr"], 1, "pr", "rg"),
    (["ev", "qu", "pr"], 2, "pr", "qu"),
])
def test_wrong_order_names_both_entries_and_the_required_order(names, bad_index, first, second):
    with pytest.raises(ConfigError) as info:
        parse_stack({"compressors": [{n: {}} for n in names]}, registry=_registry())
    msg = str(info.value)
    assert info.value.path == f"compressors[{bad_index}].{first}"
    assert f".{second}" in msg and "score -> evict -> prune / low-rank -> regroup -> quantize" in msg


@pytest.mark.parametrize("names,axis", [(["ev", "ev2"], "token eviction"), (["pr", "lr"], "key channels")])
def test_two_compressors_on_one_exclusive_axis_are_rejected(names, axis):
    with pytest.raises(ConfigError) as info:
        parse_stack({"compressors": [{n: {}} for n in names]}, registry=_registry())
    assert axis in str(info.value)
    assert f"compressors[0].{names[0]}" in str(info.value) and info.value.path == f"compressors[1].{names[1]}"


def test_validate_stack_hook_can_reject_a_combination():
    class Picky(_Obj):
        @hookimpl
        def kvcompress_validate_stack(self, entries):
            if len(entries) > 1:
                raise ConfigError("compressors[1]", "nothing after picky", entries[1][0])

    reg = _registry()
    reg.add(CompressorSpec(name="picky", axis="evict", config=_Cfg, factory=Picky), "test")
    with pytest.raises(ConfigError, match="nothing after picky"):
        parse_stack({"compressors": [{"picky": {}}, {"qu": {}}]}, registry=reg)


def test_yaml_reader_rejects_duplicate_keys():
    with pytest.raises(ConfigError, match="duplicate key"):
        read_yaml("a: 1\na: 2\n", "x.yaml")


def test_error_message_format_is_stable():
    err = ConfigError("compressors[1].window.recent", "an integer >= 1", -3)
    assert re.fullmatch(r"compressors\[1\]\.window\.recent: expected an integer >= 1, got -3", str(err))


def test_a_budget_swallowed_by_another_compressors_window_is_refused_naming_both():
    # window keeps sinks 4 + 100 tokens; kivi keeps a full-precision window of 128: no middle token would survive
    with pytest.raises(ConfigError) as info:
        parse_stack({"compressors": [{"window": {"sinks": 4, "recent": 100}}, {"kivi": {"residual": 128}}]})
    msg = str(info.value)
    assert info.value.path == "compressors[0].window"
    assert "budget of 104 tokens" in msg and "compressors[1].kivi" in msg and "= 132" in msg
    parse_stack({"compressors": [{"window": {"sinks": 4, "recent": 200}}, {"kivi": {"residual": 128}}]})


def test_any_compressor_declaring_a_budget_gets_the_check():
    class Budgeted(_Obj):
        @hookimpl
        def kvcompress_layer_layout(self, layer):
            return Layout(sinks=2, recent=0, flush=1, budget=40)

    class Windowed(_Obj):
        @hookimpl
        def kvcompress_layer_layout(self, layer):
            return Layout(sinks=8, recent=32, flush=8)

    reg = _registry()
    reg.add(CompressorSpec(name="budgeted", axis="evict", config=_Cfg, factory=Budgeted), "test")
    reg.add(CompressorSpec(name="windowed", axis="quantize", config=_Cfg, factory=Windowed), "test")
    with pytest.raises(ConfigError, match=r"8 sinks from compressors\[1\]\.windowed \+ a recent window of 32"):
        parse_stack({"compressors": [{"budgeted": {}}, {"windowed": {}}]}, registry=reg)
    assert Layout.combine([Layout(budget=40), Layout(budget=30), Layout()]).budget == 30


@pytest.mark.parametrize("given", [[{"kivi": {"bits": 2}}], 3, b"stack.yaml"])
def test_a_stack_of_the_wrong_type_is_a_config_error_naming_the_accepted_forms(given):
    """kvcompress.compress(model, [...]) used to end in a TypeError from os.fspath; the error now says what a stack
    may be, and for a list where it belongs."""
    from kvcompress.stack import as_stack

    with pytest.raises(ConfigError, match=r"^stack: expected a kvcompress\.Stack, a path to a YAML stack file, a "
                                          r"mapping \{'compressors': \[\.\.\.\]\} or None, got ") as err:
        as_stack(given)
    assert ("goes under 'compressors'" in str(err.value)) == isinstance(given, list)
