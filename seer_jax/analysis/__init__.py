"""Research code: oracle and diagnostic scheduling policies, drafting replay and bounds.

Nothing in the production layers (pallas, model, drafting, engine, rollout, sim) imports this
package; benchmarks, the CLI's comparison runs and tests do.
"""
