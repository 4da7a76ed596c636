"""bench/merge_recovery.py: the KL-stage settings that no longer exist do not split runs calibrated alike."""
import importlib.util
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "merge_recovery.py"


def test_retired_kl_settings_at_their_off_value_compare_equal_to_absent():
    spec = importlib.util.spec_from_file_location("merge_recovery", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old = {"kl": {"steps": 300, "attn_input_weight": 0.0, "attn_map_weight": 0.0, "attn_query_weight": 0.0}}
    assert mod.calib_conflicts({"a": old, "b": {"kl": {"steps": 300}}}) == []
    used = {"kl": {"steps": 300, "attn_query_weight": 5.0}}  # a run that did use one is another calibration
    assert mod.calib_conflicts({"a": used, "b": {"kl": {"steps": 300}}}) == [
        'kl: a {"attn_query_weight": 5.0, "steps": 300}; b {"steps": 300}']
