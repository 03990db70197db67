"""The simulated-accelerator backend (``--backend sim``): pdserve's real engine bookkeeping
(paged blocks, continuous batching, prefix cache, KV events, hand-offs) with the forward pass
replaced by a timing model of a modelled accelerator and model (see ``docs/simulation.md``)."""
