"""Running one engine on several ranks: the communicator interface and its implementations
(``local`` shared memory for the numpy backend and CI, ``nccl`` for GPUs), and the launcher glue."""
