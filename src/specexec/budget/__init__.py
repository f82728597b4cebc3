"""How much to speculate: lookahead schedules and stopping rules that adapt during generation, and the
interfaces the drafters use them through, one module per concept:

- `interfaces`: what the drafters ask of a policy (nothing else of it);
- `costs`: the measured forward times (`CostModel`) and how the target's passes run against them;
- `acceptance`: how likely a draft token is to be accepted (`AcceptanceModel`, `ConfidenceStop`);
- `gate`: whether drafting has been paying (`SpeculationGate`, the achieved rate λ);
- `policy`: what both auto policies decide before a step drafts (`DraftingPolicy`);
- `trees`: the SpecExec tree per step (`AutoBudget`); `chains`: a chain's length (`ChainCostStop`,
  `HeuristicLookahead`).

What they learn is kept across generations by `specexec.learnt.LearntPolicies`."""
