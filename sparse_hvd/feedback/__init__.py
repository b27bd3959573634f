"""One rank's side of a step around the exchange: error feedback (residuals, DGC velocities),
the step's payload and routes, 16-bit compression, local clipping, accumulation of backward
passes, loss scaling for mixed precision, and the non-finite guard."""
