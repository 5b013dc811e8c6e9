import dataclasses
import itertools

import pytest

from qsync_lab.simulate import PlanEvaluator
from qsync_lab.allocate import chain_costs, op_choices, risk_frontier
from qsync_lab.allocate.exact import AdditiveInstance, exact_plan


def _chain_us(chain, plan):
    return sum(chain.node_us[k, chain.column(p)] + chain.edge_us(k, plan[k - 1] if k else None, p)
               for k, p in enumerate(plan))


def test_frontier_is_the_brute_force_frontier_of_a_chain_with_casts(small_case):
    prepared, cluster, costs, scores = small_case
    evaluator = PlanEvaluator(prepared, cluster, costs)
    choices = op_choices(prepared.work, scores, evaluator.devices["T4"])
    chain = chain_costs(prepared.work, choices.ops, evaluator.devices["T4"], costs, batch_size=32,
                        memory=evaluator.memory_model)
    frontier = risk_frontier(chain, choices)
    plans = [(_chain_us(chain, plan), choices.risk(dict(zip(choices.ops, plan))))
             for plan in itertools.product(*choices.ladders)]
    cheapest = min(us for us, _ in plans)
    tolerance = 1e-2 * (max(us for us, _ in plans) - cheapest)
    found = [(_chain_us(chain, frontier.plan(i)), risk) for i, risk in enumerate(frontier.risk)]
    for i, (us, risk) in enumerate(found):
        assert choices.risk(dict(zip(choices.ops, frontier.plan(i)))) == pytest.approx(risk)
        assert us - cheapest == pytest.approx(frontier.cost[i], abs=tolerance)
    for us, risk in plans:   # no plan beats the frontier (up to the rounding of the time)
        assert min(r for u, r in found if u <= us + tolerance) <= risk + 1e-12


@pytest.mark.parametrize("resource", ["time", "memory"])
def test_best_frontier_plan_within_the_limit_is_the_exact_optimum(resource):
    for seed in range(5):
        inst = AdditiveInstance.random(ops=8, seed=seed)
        if resource == "memory":
            least = inst.memory_bytes({k: ladder[0] for k, ladder in
                                       enumerate(inst.choices.ladders)})
            inst = dataclasses.replace(inst, target_us=inst.base_us,
                                       budget_bytes=(least + inst.base_bytes) / 2)
        frontier = risk_frontier(inst.chain(), inst.choices, resource=resource)
        within = [risk for i, risk in enumerate(frontier.risk)
                  if inst.time_us(dict(enumerate(frontier.plan(i)))) <= inst.target_us
                  and inst.memory_bytes(dict(enumerate(frontier.plan(i)))) <= inst.budget_bytes]
        assert min(within) == pytest.approx(inst.risk(exact_plan(inst)))


def test_frontier_rejects_an_unknown_resource():
    inst = AdditiveInstance.random(ops=3)
    with pytest.raises(ValueError, match="resource"):
        risk_frontier(inst.chain(), inst.choices, resource="energy")
