"""The math, with no communication: the pairwise operator (`operator`), the reduction tree over any
number of workers (`tree`), single-process Adasum (`reduce`), flat-buffer layouts (`layout`) and
the tile tables the GPU kernels run on (`tiles`)."""
