import torch

torch.set_num_threads(1)  # the CI box has 2 cores shared with other jobs
