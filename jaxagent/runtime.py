"""The JAX runtime of an entry point (`launch`, `export`, `evaluate`): multi-host init and
process-0-only logging. Kept apart from `jaxagent.launch`, whose import defines its flags."""
import logging


def init_runtime(coordinator_address=None, num_processes=None, process_id=None) -> bool:
  """Multi-host init (flags, else the JAX_* environment) and process-0-only logging.

  Returns True when JAX's distributed runtime was started.
  """
  import jax

  from jaxagent import sharding
  # CPU processes exchange collectives through gloo (the default in recent JAX; older
  # versions had none). The setting only affects the CPU backend.
  try:
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
  except (AttributeError, ValueError):
    pass
  started = sharding.initialize_distributed(coordinator_address, num_processes, process_id)
  jax.config.update("jax_threefry_partitionable", True)
  if jax.process_index() != 0:
    logging.getLogger().setLevel(logging.WARNING)
  return started
