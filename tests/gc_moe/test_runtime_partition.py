import pytest
from gc_moe.runtime.partition import PartitionError, dispatch_request, plan_partition

# (request -> comm/compute) read off an H200 (132 SMs, alignment 8) with cuDevSmResourceSplitByCount
H200_SPLITS = {2: (4, 128), 4: (4, 128), 8: (12, 120), 16: (20, 112), 20: (20, 112), 24: (28, 104), 32: (36, 96)}


@pytest.mark.parametrize("request_sms,expected", sorted(H200_SPLITS.items()))
def test_plan_matches_the_driver_split_on_h200(request_sms, expected):
    plan = plan_partition(132, request_sms, alignment=8, min_partition=8)
    assert (plan.comm_sms, plan.compute_sms) == expected
    assert plan.comm_sms + plan.compute_sms == 132


def test_plan_on_b300_reserves_20_of_148():
    plan = plan_partition(148, 16, alignment=8, min_partition=8)
    assert (plan.comm_sms, plan.compute_sms) == (20, 128)


@pytest.mark.parametrize("total,request_sms,alignment,message", [
    (40, 10, 8, "below the minimum 32"),         # compute 24
    (132, 131, 8, "below the minimum 32"),
    (71, 2, 1, "69 SMs is odd"),                  # alignment 1 lets the compute count be odd
    (65, 1, 2, "communication partition of 1 SMs is below the minimum 2"),
    (132, 0, 8, "between 1 and 131"),
    (132, 132, 8, "between 1 and 131"),
])
def test_invalid_plans_say_what_is_wrong(total, request_sms, alignment, message):
    with pytest.raises(PartitionError, match=message):
        plan_partition(total, request_sms, alignment=alignment, min_partition=1)


def test_dispatch_request_defaults_and_env():
    assert dispatch_request("sm90", {}) == 4
    assert dispatch_request("sm100", {}) == 16
    assert dispatch_request("sm90", {"GC_MOE_SM90_DISPATCH_SMS": "12"}) == 12
    assert dispatch_request("sm100", {"GC_MOE_DISPATCH_SMS": "24", "GC_MOE_SM90_DISPATCH_SMS": "3"}) == 24
    with pytest.raises(PartitionError, match="not an integer"):
        dispatch_request("sm90", {"GC_MOE_SM90_DISPATCH_SMS": "four"})
    with pytest.raises(PartitionError, match="at least 1"):
        dispatch_request("sm100", {"GC_MOE_DISPATCH_SMS": "0"})
    with pytest.raises(PartitionError, match="unknown arch family"):
        dispatch_request("sm80", {})
