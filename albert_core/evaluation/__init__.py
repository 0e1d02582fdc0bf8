"""Measuring a model: intrinsic held-out MLM/SOP/NSP (`intrinsic`), the unigram floor they are read against
(`unigram`), task metrics (`metrics`) and probes of what the model learned (`analysis`)."""
