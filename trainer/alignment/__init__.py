"""Policy alignment on synthetic preferences (ARCHITECTURE.md §7, FedPrism Phase III): causal-LM
loading (:mod:`trainer.alignment.policy_models`) and DPO with TRL (:mod:`trainer.alignment.dpo`)."""
