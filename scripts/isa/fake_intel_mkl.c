/* make test-isa: oneMKL asks this function whether the CPU is an Intel one and picks its kernels by the answer.
   Preloaded on an AMD machine it answers yes, so oneMKL runs the kernels it runs on an Intel Xeon (at the vector width
   this CPU has): their blocking follows a matmul's output width, so a column shard of a matmul no longer gives the same
   bits as the whole one. That is what made the Float8 parity cells fail on the Intel Xeon with AMX (issue 43). */
int mkl_serv_intel_cpu_true(void) { return 1; }
