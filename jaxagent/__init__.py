"""jaxagent: JAX-native agentic reinforcement learning for language models.

Data flow (see DESIGN in the repository): configs -> launch -> trainer, which drives
envs + agent rollouts over the generator, scores them with rewards, and updates the
policy with the masked losses in `jaxagent.rl` over packed rows.
"""

__version__ = "0.1.0"
