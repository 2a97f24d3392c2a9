"""Field positions in text-format and YAML jobs, keyed by field path."""

from __future__ import annotations

import yaml

from shoal.config.positions import SourceMap, enclosing, text_positions, yaml_positions

SINGA_SYNTAX = """\
# comment: name: "not a field"
name:"a" "b"   # adjacent strings concatenate
gpu: [0, 1]
updater{ clip_low: -5; clip_high: 5, }
neuralnet {
  layer: [{ name: "x" }, { name: "y" srclayers: "x" }]
  layer <
    name: 'z#1'
    srclayers: "y"
    srclayers: "x"
    param { name: "w" }
    store_conf: { shape: 3 shape: 32 }
  >
}
"""


def test_text_positions_cover_singa_syntax():
    positions = text_positions(SINGA_SYNTAX)
    expected = {
        "name": (2, 6),
        "gpu": (3, 1),
        "gpu[0]": (3, 7),
        "gpu[1]": (3, 10),
        "updater": (4, 1),
        "updater.clip_low": (4, 20),
        "updater.clip_high": (4, 35),
        "neuralnet": (5, 1),
        "neuralnet.layer[0]": (6, 11),
        "neuralnet.layer[0].name": (6, 19),
        "neuralnet.layer[1].srclayers[0]": (6, 49),
        "neuralnet.layer[2]": (7, 3),
        "neuralnet.layer[2].name": (8, 11),
        "neuralnet.layer[2].srclayers[0]": (9, 16),
        "neuralnet.layer[2].srclayers[1]": (10, 16),
        "neuralnet.layer[2].param[0].name": (11, 19),
        "neuralnet.layer[2].store_conf": (12, 5),
        "neuralnet.layer[2].store_conf.shape[1]": (12, 35),
    }
    assert {key: positions.get(key) for key in expected} == expected
    assert not any("not a field" in key or key.startswith("comment") for key in positions)


def test_yaml_positions():
    text = "name: a\nneuralnet:\n  layer:\n    - {name: x, srclayers: y}\n    - name: z\n      srclayers: [x, y]\n"
    positions = yaml_positions(yaml.compose(text, Loader=yaml.SafeLoader))
    assert positions["name"] == (1, 7)
    assert positions["neuralnet"] == (2, 1)
    assert positions["neuralnet.layer[0]"] == (4, 7)
    assert positions["neuralnet.layer[0].srclayers[0]"] == (4, 28)  # a scalar given for a repeated field
    assert positions["neuralnet.layer[1].srclayers[1]"] == (6, 22)


def test_errors_point_at_the_nearest_written_field():
    sources = SourceMap("job.conf", text_positions(SINGA_SYNTAX))
    assert str(sources.error("neuralnet.layer[2].srclayers[1]", "bad")) == "job.conf:10:16: bad"
    assert str(sources.error("neuralnet.layer[2].convolution_conf.kernel", "bad")) == "job.conf:7:3: bad"
    assert str(sources.error("cluster.nworker_groups", "bad")) == "job.conf: cluster.nworker_groups: bad"
    sources.override("neuralnet.layer[2].srclayers", "neuralnet.layer[2].srclayers=q")
    assert str(sources.error("neuralnet.layer[2].srclayers[1]", "bad")) == "--set neuralnet.layer[2].srclayers=q: bad"
    assert list(enclosing("a.b[3].c")) == ["a.b[3].c", "a.b[3]", "a.b", "a"]
