"""What each worker sends: the sparsifiers (which entries), the density policies (how many per
variable and step: constant, warm-up, LAGS' adaptive one, the defaults), the model-wide budget
and the dense fallback (which variables are not worth sparsifying on this job)."""
