"""The only package that orchestrates (asyncio): the training engine, job runners, round strategies and the verifier. May import: coordinator.market | nodes | trust and below, epochmesh."""
