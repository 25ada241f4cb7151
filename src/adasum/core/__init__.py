"""The math, with no communication: the pairwise operator (`operator`), the reduction tree over any
number of workers (`tree`), flat-buffer layouts (`layout`) and the tile tables the GPU kernels run
on (`tiles`). Imports nothing else of adasum; single-process Adasum (`adasum.kernels.reduce`) runs
on the kernels."""
