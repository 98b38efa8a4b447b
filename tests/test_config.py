"""The "sdp4bit" block: defaults, refusals with did-you-mean, cross-checks, and every shipped config."""

import json
import pathlib
import re

import pytest

from deepspeed_sdp4bit.config import (SDP4BitConfig, SDP4BitConfigError, find_block, parse_block,
                                      parse_ds_config)

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / "configs"


def _zero3(**zero):
    return {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
            "zero_optimization": {"stage": 3, **zero}}


def test_defaults_follow_the_paper():
    c = parse_block({})
    assert c.active and c.weights.mode == "diff" and c.weights.bits == 4 and c.weights.group_size == 2048
    assert (c.gradients.intra_bits, c.gradients.inter_bits, c.gradients.group_size) == (8, 4, 128)
    assert c.gradients.hadamard and c.gradients.hadamard_size == 32
    assert c.topology.gpus_per_node is None and c.kernel_backend is None and c.backend_name == "auto"


def test_absent_block_is_inactive():
    assert not parse_ds_config(_zero3()).active


@pytest.mark.parametrize("block, key, hint", [
    ({"gradient": {}}, "gradient", "gradients"),
    ({"weights": {"group_sise": 64}}, "group_sise", "group_size"),
    ({"gradients": {"hadamard_sz": 64}}, "hadamard_sz", "hadamard_size"),
    ({"kernel_backed": "torch"}, "kernel_backed", "kernel_backend"),
])
def test_unknown_keys_name_the_key_and_suggest(block, key, hint):
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block(block)
    assert repr(key) in str(e.value) and f"did you mean {hint!r}" in str(e.value)


@pytest.mark.parametrize("block, where, home", [
    ({"hadamard": True}, "sdp4bit", "sdp4bit.gradients.hadamard"),
    ({"weights": {"inter_bits": 4}}, "sdp4bit.weights", "sdp4bit.gradients.inter_bits"),
    ({"gradients": {"replica": "full"}}, "sdp4bit.gradients", "sdp4bit.weights.replica"),
    ({"weights": {"gpus_per_node": 2}}, "sdp4bit.weights", "sdp4bit.topology.gpus_per_node"),
])
def test_a_key_in_the_wrong_section_is_sent_where_it_belongs(block, where, home):
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block(block)
    assert f"{where}: unknown key" in str(e.value) and f"it belongs in {home} " in str(e.value)


@pytest.mark.parametrize("block, where", [
    ({"weights": {"bits": 3}}, "weights.bits"),
    ({"weights": {"mode": "delta"}}, "weights.mode"),
    ({"weights": {"group_size": 100}}, "weights.group_size"),
    ({"gradients": {"intra_bits": 2}}, "gradients.intra_bits"),
    ({"gradients": {"hadamard_size": 48}}, "gradients.hadamard_size"),
    ({"gradients": {"hadamard_size": 512}}, "gradients.hadamard_size"),
    ({"gradients": {"group_size": 32, "hadamard_size": 64}}, "gradients: group_size (32) must be a multiple of "
                                                              "hadamard_size (64)"),
    ({"gradients": {"group_size": 100}}, "gradients: group_size must be a multiple of 32"),
    ({"weights": [1]}, "weights: must be a JSON object of keys, got [1]"),
    ({"gradients": {"rounding": "up"}}, "gradients.rounding"),
    ({"gradients": {"pipeline_chunks": 0}}, "gradients.pipeline_chunks"),
    ({"gradients": {"inter8_steps": -5}}, "gradients.inter8_steps"),
    ({"gradients": {"inter8_steps": 100, "inter_bits": 8}}, "gradients: inter8_steps sends the inter-node level at 8 "
                                                            "bits before it drops to inter_bits 4, but inter_bits is 8"),
    ({"topology": {"gpus_per_node": 0}}, "topology.gpus_per_node"),
    ({"kernel_backend": "cutlass"}, "kernel_backend"),
    ({"seed": -1}, "seed"),
])
def test_bad_values_are_refused_with_the_key(block, where):
    with pytest.raises(SDP4BitConfigError, match=re.escape(where)):
        parse_block(block)


def test_group_size_without_hadamard_needs_no_multiple_of_hadamard():
    c = parse_block({"gradients": {"hadamard": False, "group_size": 96, "hadamard_size": 64}})
    assert c.gradients.group_size == 96


def test_block_must_be_an_object():
    with pytest.raises(SDP4BitConfigError, match="JSON object"):
        parse_block([1, 2])


@pytest.mark.parametrize("key", ["sdp4bits", "SDP4Bit", "sdp_4bit", "sdp4-bit", "sdpbit4"])
def test_misspelt_top_level_key_is_not_ignored(key):
    with pytest.raises(SDP4BitConfigError, match="did you mean 'sdp4bit'"):
        find_block({**_zero3(), key: {}})


def test_unrelated_top_level_keys_pass():
    assert find_block({**_zero3(), "steps_per_print": 10, "sparse_attention": {}}) is None


@pytest.mark.parametrize("zero, match", [
    ({"stage": 2}, "stage = 3"),
    ({"zero_quantized_gradients": True}, "zero_quantized_gradients"),
    ({"zero_quantized_weights": True}, "zero_quantized_weights"),
    ({"offload_optimizer": {"device": "cpu"}}, "offload_optimizer"),
    ({"offload_param": {"device": "nvme"}}, "offload_param"),
])
def test_unsupported_ds_config_combinations(zero, match):
    cfg = _zero3()
    cfg["zero_optimization"].update(zero)
    cfg["sdp4bit"] = {}
    with pytest.raises(SDP4BitConfigError, match=match):
        parse_ds_config(cfg)


@pytest.mark.parametrize("top, match", [
    # DeepSpeed reads its own keys laxly (pydantic): "true", 1 and "2" count as they would there
    ({"bf16": {"enabled": True, "bf16_master_weights_and_grads": "true"}}, "bf16.bf16_master_weights_and_grads"),
    ({"bfloat16": {"enabled": True, "bf16_master_weights_and_grads": 1}}, "bfloat16.bf16_master_weights_and_grads"),
    ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.fp16_master_weights_and_grads"),
    ({"compile": {"deepcompile": "yes"}}, "compile.deepcompile"),
    ({"tensor_parallel": {"autotp_size": "2"}}, "tensor_parallel.autotp_size='2'"),
])
def test_ds_features_sdp4bit_cannot_follow_are_refused(top, match):
    cfg = {**_zero3(), **top, "sdp4bit": {}}
    with pytest.raises(SDP4BitConfigError, match=re.escape(match)):
        parse_ds_config(cfg)


@pytest.mark.parametrize("top", [
    {"bf16": {"enabled": True, "bf16_master_weights_and_grads": False}},
    {"compile": {"deepcompile": "false"}},
    {"tensor_parallel": {"autotp_size": 1}},
    {"tensor_parallel": {"autotp_size": "0"}},
])
def test_ds_features_off_are_accepted(top):
    assert parse_ds_config({**_zero3(), **top, "sdp4bit": {}}).active


def test_master_weights_in_16_bits_allowed_without_sdp4bit_weights():
    cfg = {**_zero3(), "bf16": {"enabled": True, "bf16_master_weights_and_grads": True},
           "sdp4bit": {"weights": {"enabled": False}}}
    assert parse_ds_config(cfg).active   # the gradient path alone needs no fp32 master


def test_hpz_must_match_gpus_per_node_for_node_replica():
    cfg = {**_zero3(zero_hpz_partition_size=4), "sdp4bit": {"topology": {"gpus_per_node": 2}}}
    with pytest.raises(SDP4BitConfigError, match="zero_hpz_partition_size"):
        parse_ds_config(cfg)
    cfg = {**_zero3(zero_hpz_partition_size=2), "sdp4bit": {"weights": {"replica": "full"}}}
    with pytest.raises(SDP4BitConfigError, match="replica='full'"):
        parse_ds_config(cfg)


def test_disabled_block_skips_cross_checks():
    cfg = {**_zero3(), "sdp4bit": {"enabled": False}}
    cfg["zero_optimization"]["stage"] = 2
    assert not parse_ds_config(cfg).active


def test_every_shipped_config_parses():
    files = sorted(CONFIG_DIR.glob("*.json"))
    names = {f.stem for f in files}
    assert {"zero3", "zeropp", "sdp4bit", "qw", "qwd", "ulq", "tlq", "tlq_hs"} <= names, names
    for f in files:
        cfg = parse_ds_config(json.loads(f.read_text()))
        assert isinstance(cfg, SDP4BitConfig)
        assert cfg.active == ("sdp4bit" in json.loads(f.read_text())), f.name


# --------------------------------------------------------------------------------------------------------
# values that must survive Hugging Face accelerate, and the JSON quirks of issue 22
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block, where, meant", [
    ({"topology": {"gpus_per_node": "auto"}}, "sdp4bit.topology.gpus_per_node", "LOCAL_WORLD_SIZE"),
    ({"kernel_backend": "auto"}, "sdp4bit.kernel_backend", "fastest kernel backend"),
    ({"gradients": {"group_size": "AUTO"}}, "sdp4bit.gradients.group_size", "its default"),
])
def test_auto_is_refused_naming_the_key_and_saying_to_omit_it(block, where, meant):
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block(block)
    msg = str(e.value)
    assert where in msg and "omit the key" in msg and meant in msg and "accelerate" in msg


def test_no_auto_string_in_shipped_configs():
    # accelerate treats any "auto" anywhere in a ds_config as its placeholder; ours are omitted keys
    for path in sorted(CONFIG_DIR.glob("*.json")):
        assert '"auto"' not in path.read_text(), path.name


@pytest.mark.parametrize("block, where", [
    ({"topology": {"gpus_per_node": True}}, "sdp4bit.topology.gpus_per_node"),
    ({"seed": False}, "sdp4bit.seed"),
    ({"weights": {"bits": True}}, "sdp4bit.weights.bits"),
    ({"gradients": {"pipeline_chunks": True}}, "sdp4bit.gradients.pipeline_chunks"),
])
def test_booleans_are_not_integers(block, where):
    with pytest.raises(SDP4BitConfigError, match=where.replace(".", r"\.") + ": must be an integer, got (true|false)"):
        parse_block(block)


@pytest.mark.parametrize("block,where,said", [
    ({"gradients": {"inter_bits": "4"}}, "sdp4bit.gradients.inter_bits", 'an integer, got "4" (a string)'),
    ({"gradients": {"group_size": "2048"}}, "sdp4bit.gradients.group_size", 'an integer, got "2048" (a string)'),
    ({"weights": {"full_replica_budget": "0.5"}}, "sdp4bit.weights.full_replica_budget",
     'a number, got "0.5" (a string)'),
    ({"weights": {"full_replica_budget": False}}, "sdp4bit.weights.full_replica_budget",
     "a number, got false (a boolean)"),
    # lax pydantic reads these words and numbers as booleans: a typo'd word could switch a feature off
    ({"gradients": {"hadamard": "no"}}, "sdp4bit.gradients.hadamard", '`true` or `false`, got "no" (a string)'),
    ({"enabled": "off"}, "sdp4bit.enabled", '`true` or `false`, got "off" (a string)'),
    ({"quantize_single_node": 1}, "sdp4bit.quantize_single_node", "`true` or `false`, got 1 (an integer)"),
    ({"weights": {"enabled": None}}, "sdp4bit.weights.enabled", "`true` or `false`, got null"),
    ({"gradients": {"group_size": [128]}}, "sdp4bit.gradients.group_size", "an integer, got [128] (a list)"),
])
def test_a_value_of_the_wrong_json_type_is_refused_naming_what_was_given(block, where, said):
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block(block)
    assert f"{where}: must be {said}" in str(e.value)


def test_overlap_omitted_is_the_automatic_choice_and_its_threshold_belongs_to_it():
    w = parse_block({}).weights
    assert w.overlap is None and w.overlap_below_gbps == 6.0
    assert parse_block({"weights": {"overlap": None}}).weights.overlap is None   # null = omitted
    assert parse_block({"weights": {"overlap_below_gbps": 2}}).weights.overlap_below_gbps == 2.0
    for given in (True, False):   # a forced value takes no threshold: one of the two keys is a mistake
        with pytest.raises(SDP4BitConfigError, match=r"sdp4bit\.weights: overlap_below_gbps is read only when "
                                                     rf"overlap is omitted .*, but overlap is {str(given).lower()}"):
            parse_block({"weights": {"overlap": given, "overlap_below_gbps": 2}})
    for bad in (0, -1, 2e6):
        with pytest.raises(SDP4BitConfigError, match=r"sdp4bit\.weights\.overlap_below_gbps"):
            parse_block({"weights": {"overlap_below_gbps": bad}})
    with pytest.raises(SDP4BitConfigError, match="omit the key for the automatic choice"):
        parse_block({"weights": {"overlap": "auto"}})


def test_numbers_of_either_json_kind_and_null_where_allowed_still_read():
    c = parse_block({"weights": {"full_replica_budget": 1, "bits": 4.0}, "topology": {"gpus_per_node": None}})
    assert c.weights.full_replica_budget == 1.0 and c.weights.bits == 4 and c.topology.gpus_per_node is None
    # a ds_config built in Python may carry numpy scalars: read as their JSON kinds
    np = pytest.importorskip("numpy")
    c = parse_block({"seed": np.int64(4), "weights": {"full_replica_budget": np.float32(0.5), "overlap": np.bool_(True)}})
    assert c.seed == 4 and c.weights.full_replica_budget == 0.5 and c.weights.overlap is True
    with pytest.raises(SDP4BitConfigError, match=r"sdp4bit\.weights\.overlap: must be `true` or `false`, got np\.int64\(1\)"):
        parse_block({"weights": {"overlap": np.int64(1)}})


def test_booleans_still_fine_for_boolean_keys():
    c = parse_block({"enabled": True, "gradients": {"hadamard": False}})
    assert c.active and not c.gradients.hadamard


def test_a_missing_zero_block_is_said_with_a_near_spelling():
    with pytest.raises(SDP4BitConfigError, match=r"got 0 \(no zero_optimization block; the ds_config has "
                                                 r"'zero_optimisation': a misspelling\?\)"):
        parse_ds_config({"zero_optimisation": {"stage": 3}, "sdp4bit": {}})
    with pytest.raises(SDP4BitConfigError, match=r"got 0 \(no zero_optimization block\)$"):
        parse_ds_config({"sdp4bit": {}})
    with pytest.raises(SDP4BitConfigError, match=r"zero_optimization to be a block with stage 3.*got True"):
        parse_ds_config({"zero_optimization": True, "sdp4bit": {}})   # DeepSpeed's legacy form: stage 1


def test_string_stage_is_read_like_deepspeed_reads_it():
    assert parse_ds_config({**_zero3(), "zero_optimization": {"stage": "3"}, "sdp4bit": {}}).active
    with pytest.raises(SDP4BitConfigError, match="stage = 3.*got '2'"):
        parse_ds_config({**_zero3(), "zero_optimization": {"stage": "2"}, "sdp4bit": {}})


def test_null_block_is_an_error_like_any_non_object():
    with pytest.raises(SDP4BitConfigError, match=r"null.*\{\"enabled\": false\}"):
        parse_ds_config({**_zero3(), "sdp4bit": None})
    with pytest.raises(SDP4BitConfigError, match="JSON object"):
        parse_ds_config({**_zero3(), "sdp4bit": True})
    assert not parse_ds_config({**_zero3(), "sdp4bit": {"enabled": False}}).active


def test_readme_key_table_is_the_config_itself():
    """README.md's key reference is ``config.key_table()`` (every key with a description, default, allowed values):
    a key added, removed or changed without the README fails here."""
    from deepspeed_sdp4bit.config import key_table

    readme = (pathlib.Path(__file__).resolve().parent.parent / "README.md").read_text()
    block = readme.split("<!-- config:keys:begin -->\n", 1)[1].split("<!-- config:keys:end -->", 1)[0]
    assert block == key_table(), "README.md's key table is stale: replace it by `python -m deepspeed_sdp4bit --keys`"
    keys = [line.split("`")[1] for line in block.splitlines()[2:]]
    assert "weights.replica" in keys and "gradients.align_params" in keys and "topology.gpus_per_node" in keys
    assert all(not k.endswith(("weights", "gradients", "topology")) for k in keys)   # sections are not keys


@pytest.mark.parametrize("block,line", [
    ({"weights": {"bits": 3}}, "sdp4bit.weights.bits: Input should be 4 or 8, got 3 (an integer)"),
    ({"weights": {"replica": "Full"}}, """sdp4bit.weights.replica: Input should be 'node' or 'full', got "Full" (a string)"""),
])
def test_a_value_outside_the_allowed_ones_says_what_was_given(block, line):
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block(block)
    assert line in str(e.value).splitlines()[1]


def test_every_problem_of_a_block_in_one_message():
    """A value of the wrong JSON type and an unknown key in one block: one error names both, each once, so a user
    does not fix one to be shown the other."""
    for block, unknown in (({"weight": {}, "gradients": {"inter_bits": "4"}}, "'weight'; did you mean 'weights'?"),
                           ({"gradients": {"inter_bits": "4", "group_sise": 64}},
                            "'group_sise'; did you mean 'group_size'?")):
        with pytest.raises(SDP4BitConfigError) as e:
            parse_block(block)
        lines = str(e.value).splitlines()[1:]
        assert len(lines) == 2, lines
        assert lines[0].startswith('  sdp4bit.gradients.inter_bits: must be an integer, got "4"'), lines
        assert "unknown key " + unknown in lines[1], lines
    # every unknown key of a block in one line; a check across keys that read a value the raw check refused
    # (true read as 1) is not reported beside it
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block({"weights": {"a": 1, "b": 2}})
    assert "unknown key 'a'; unknown key 'b' (allowed here:" in str(e.value)
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block({"gradients": {"inter8_steps": True, "inter_bits": 8}})
    assert str(e.value).splitlines()[1:] == ["  sdp4bit.gradients.inter8_steps: must be an integer, got true "
                                             "(a boolean)"]
    # a key the raw check names is not named again by the model ("auto" is not 4 or 8 either); a range error
    # of another key is
    with pytest.raises(SDP4BitConfigError) as e:
        parse_block({"gradients": {"inter_bits": "auto"}, "weights": {"bits": 5}})
    lines = str(e.value).splitlines()[1:]
    assert len(lines) == 2 and '"auto" is not a value here' in lines[0], lines
    assert lines[1].startswith("  sdp4bit.weights.bits: Input should be 4 or 8, got 5"), lines


def test_never_overlaps_says_why_a_config_cannot_overlap_its_refresh():
    assert parse_block(None).never_overlaps == "runs without SDP4Bit"
    assert parse_block({"enabled": False}).never_overlaps == "runs without SDP4Bit"
    assert parse_block({"weights": {"enabled": False}}).never_overlaps == "runs without the weight replica"
    assert parse_block({"weights": {"overlap": False}}).never_overlaps == "turns off"
    assert parse_block({}).never_overlaps is None   # omitted: the engine decides
    assert parse_block({"weights": {"overlap": True}}).never_overlaps is None
