"""The interval:K keep policy: attention last in every K layers, (i + 1) % K == 0 (Qwen3.5's own placement, the
only one SGLang runs), and what it refuses."""
import re

import pytest
from helpers import tiny_teacher

import tcal
from tcal.conversion.policy import Policy, parse_policy
from tcal.conversion.select import select_layers
from tcal.engines.placement import interval_layers, periodic_interval
from tcal.utils.errors import TcalError


def test_interval_layers_and_their_period():
    assert interval_layers(2, 30) == list(range(1, 30, 2))
    assert interval_layers(4, 30) == [3, 7, 11, 15, 19, 23, 27]
    assert interval_layers(30, 30) == [29]
    for k in (2, 3, 4, 7, 30):
        assert periodic_interval(interval_layers(k, 30), 30) == k
    assert periodic_interval(list(range(0, 30, 2)), 30) is None  # uniform:50%: layer 0 first, not last
    assert periodic_interval([3, 7, 11], 16) is None  # the period stops short of the last layers


def test_parse_interval():
    assert parse_policy("interval:4", 30) == Policy("interval", 4)
    assert parse_policy("interval:4", None) == Policy("interval", 4)
    for spec, msg in (("interval:1", "keeps every layer: nothing would be converted; K must be at least 2"),
                      ("interval:0", "keeps every layer"),
                      ("interval:50%", "K is the period of the placement, a whole number like interval:4"),
                      ("interval:x", "K is the period"),
                      ("interval:\u00b2", "K is the period"),  # '²'.isdigit(), but no int
                      ("interval:4@sliding", "interval:K places attention by layer index"),
                      ("interval:31", "keeps no layer of 30: K must be at most 30")):
        with pytest.raises(TcalError, match=re.escape(msg)):
            parse_policy(spec, 30)


def test_select_and_convert_with_an_interval():
    teacher = tiny_teacher("llama", num_hidden_layers=6)
    assert select_layers(teacher, "interval:3").layers == [2, 5]
    assert select_layers(teacher, "interval:2").policy == "interval:2"
    hybrid = tcal.convert(teacher, keep="interval:2", init="copy", target="qwen3_5")
    assert [i for i, t in enumerate(hybrid.config.layer_types) if t != "linear_attention"] == [1, 3, 5]
