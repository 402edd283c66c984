"""jaxagent: JAX-native agentic reinforcement learning for language models.

Data flow (README.md, "Layout"): configs -> launch -> trainer, which drives envs + agent
rollouts over the generator, scores them with rewards, and updates the policy with the masked
losses in `jaxagent.rl` over packed rows. `jaxagent.plan` compiles a run's programs ahead of time
and checks that they fit the devices.
"""

__version__ = "0.1.0"
