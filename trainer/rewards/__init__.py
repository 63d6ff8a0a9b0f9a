"""Mixture of client reward models with a federated router (MoR, paper 001; ARCHITECTURE.md §7).

Modules: :mod:`.pair_features` (``Enc(x, y)``), :mod:`.reward_models` (Bradley-Terry client reward
models, normalisation), :mod:`.client_router` (federated router, FedAvg, Flower), :mod:`.mixture`
(routed reward, save/load).
"""
