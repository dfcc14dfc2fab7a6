"""The user-facing entry point, above every stage: the `drafter` CLI (`drafter.cli`) and the cost planner
(`drafter.plan`). It is the only code that imports every stage package (`pipeline`, `extract`, `train`, `eval`);
nothing in them imports it."""
