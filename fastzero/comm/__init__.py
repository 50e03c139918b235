"""fastzero's communication layer (issue 4, in progress): so far the
process-group setup from the launcher's environment."""

from fastzero.comm.env import DistEnv, default_backend, dist_env, init_distributed

__all__ = ["DistEnv", "default_backend", "dist_env", "init_distributed"]
