"""``ucm_sparse_config``: the GSA section, seed key names and aliases, strict errors naming the allowed values."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from ucm.config import GSAConfig, UcmConfigError, config_from_extra_config, load_config_file, parse_config


def test_off_by_default() -> None:
    assert parse_config({}).ucm_sparse_config is None
    assert parse_config({}).to_log_dict()["ucm_sparse_config"] is None


def test_gsa_defaults_filled_in() -> None:
    cfg = parse_config({"ucm_sparse_config": {"GSA": {}}})
    assert cfg.ucm_sparse_config is not None and cfg.ucm_sparse_config.method == "GSA"
    assert cfg.to_log_dict()["ucm_sparse_config"] == {
        "GSA": {
            "sparse_ratio": 0.3,
            "init_window_sz": 1,
            "local_window_sz": 2,
            "min_blocks": 4,
            "block_scoring": "sparq",
            "observation_window": 16,
            "score_channels": 16,
        },
        "ReRoPE": None,
        "Blend": None,
    }


def test_issue_example_with_short_names_inline() -> None:
    extra = {"ucm_sparse_config": {"GSA": {"sparse_ratio": 0.3, "init_window": 1, "local_window": 2, "min_blocks": 4}}}
    gsa = config_from_extra_config(extra).ucm_sparse_config.GSA  # type: ignore[union-attr]
    assert gsa == GSAConfig(sparse_ratio=0.3, init_window_sz=1, local_window_sz=2, min_blocks=4)


def test_seed_names_from_yaml(tmp_path: Path) -> None:
    path = tmp_path / "ucm.yaml"
    path.write_text(
        textwrap.dedent(
            """\
            ucm_sparse_config:
              GSA:
                sparse_ratio: 1        # an int in YAML
                init_window_sz: 0
                local_window_sz: 3
                min_blocks: 8
            """
        )
    )
    gsa = load_config_file(path).ucm_sparse_config.GSA  # type: ignore[union-attr]
    assert gsa is not None and gsa.sparse_ratio == 1.0 and gsa.local_window_sz == 3 and gsa.min_blocks == 8


def test_unknown_method_names_the_allowed_ones() -> None:
    with pytest.raises(UcmConfigError, match=r"unknown key 'ESA' in ucm_sparse_config; valid keys: Blend, GSA, ReRoPE"):
        parse_config({"ucm_sparse_config": {"ESA": {}}})


def test_unknown_key_names_the_allowed_ones() -> None:
    with pytest.raises(
        UcmConfigError,
        match=r"unknown key 'retrieval_stride' in ucm_sparse_config.GSA; valid keys: block_scoring, init_window_sz, "
        r"local_window_sz, min_blocks, observation_window, score_channels, sparse_ratio",
    ):
        parse_config({"ucm_sparse_config": {"GSA": {"retrieval_stride": 5}}})


@pytest.mark.parametrize(
    ("gsa", "message"),
    [
        ({"sparse_ratio": 0}, r"sparse_ratio: Input should be greater than 0"),
        ({"sparse_ratio": 1.5}, r"sparse_ratio: Input should be less than or equal to 1"),
        ({"sparse_ratio": "0.3"}, r"sparse_ratio: Input should be a valid number"),
        ({"local_window_sz": 0}, r"local_window_sz: Input should be greater than or equal to 1"),
        ({"init_window_sz": -1}, r"init_window_sz: Input should be greater than or equal to 0"),
        ({"min_blocks": 3}, r"min_blocks \(3\) must be larger than init_window_sz \+ local_window_sz \(1 \+ 2\)"),
        ({"block_scoring": "mean_key"}, r"block_scoring: Input should be 'key_bounds', 'attention' or 'sparq'"),
        ({"observation_window": 0}, r"observation_window: Input should be greater than or equal to 1"),
        ({"score_channels": 0}, r"score_channels: Input should be greater than or equal to 1"),
    ],
    ids=[
        "ratio-zero",
        "ratio-above-one",
        "ratio-string",
        "no-local-window",
        "negative-sinks",
        "min-blocks-small",
        "unknown-scoring",
        "no-observation-window",
        "no-score-channels",
    ],
)
def test_bad_values(gsa: dict, message: str) -> None:
    with pytest.raises(UcmConfigError, match=message):
        parse_config({"ucm_sparse_config": {"GSA": gsa}})


def test_rerope_section() -> None:
    cfg = parse_config({"ucm_sparse_config": {"ReRoPE": {"window": 512}}})
    assert cfg.ucm_sparse_config is not None and cfg.ucm_sparse_config.method == "ReRoPE"
    assert cfg.to_log_dict()["ucm_sparse_config"]["ReRoPE"] == {
        "window": 512,
        "leaky_factor": None,
        "decode_cache_gb": 1.0,
    }
    leaky = parse_config({"ucm_sparse_config": {"ReRoPE": {"window": 512, "leaky_factor": 16}}}).ucm_sparse_config
    assert leaky is not None and leaky.ReRoPE is not None and leaky.ReRoPE.leaky_factor == 16.0


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        ({"ReRoPE": {}}, "ucm_sparse_config.ReRoPE.window: Field required"),
        ({"ReRoPE": {"window": 0}}, "ucm_sparse_config.ReRoPE.window: Input should be greater than or equal to 1"),
        ({"ReRoPE": {"window": 64, "leaky_factor": 0.5}}, "leaky_factor: Input should be greater than or equal to 1"),
        ({"ReRoPE": {"window": 64, "windw": 1}}, "unknown key 'windw' in ucm_sparse_config.ReRoPE; valid keys: "),
        ({"ReRoPE": {"window": 64, "decode_cache_gb": -1}}, "decode_cache_gb: Input should be greater than or equal"),
        ({"GSA": {}, "ReRoPE": {"window": 64}}, "GSA and ReRoPE are both set"),
    ],
)
def test_rerope_errors_name_the_key(section: dict, expected: str) -> None:
    with pytest.raises(UcmConfigError) as info:
        parse_config({"ucm_sparse_config": section})
    assert expected in str(info.value)
