"""FedVPA-GP: personalised preference models with a federated Gumbel-softmax mixture prior (paper 003, second
abstract; ARCHITECTURE.md §12) and its baselines (issue 28). See docs/vpa.md."""
