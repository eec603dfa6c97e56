// The CPU kernels again, for AVX2+FMA, picked at run time by the binding only where the CPU
// has both. at::vec selects its 256-bit implementation from CPU_CAPABILITY_AVX2 (and puts it in
// the namespace at::vec::AVX2), and the target pragma lets the compiler emit those instructions
// without a global -mavx2, which would make the whole module need AVX2.
//
// Every header that is not ours or at::vec's is included BEFORE the pragma: its inline
// functions are then compiled for baseline x86-64, so when the linker merges them with the
// generic build's copies it cannot pick an AVX2 one. What follows the pragma is either in
// namespaces of its own (shardamp::cpu::avx2, at::vec::AVX2) or instantiated on types of its own.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include "../common.h"

#include <ATen/Parallel.h>

#include <cmath>
#include <tuple>
#include <vector>

#pragma GCC target("avx2,fma,f16c")
// The pragma enables the instructions but not the feature macros that headers (sleef.h among
// them) test, so those are set by hand for the rest of this translation unit.
#ifndef __AVX__
#define __AVX__ 1
#endif
#ifndef __AVX2__
#define __AVX2__ 1
#endif
#ifndef __FMA__
#define __FMA__ 1
#endif
#ifndef __F16C__
#define __F16C__ 1
#endif
#define CPU_CAPABILITY AVX2
#define CPU_CAPABILITY_AVX2
#define SHARDAMP_CPU_CAPABILITY avx2
#include "fused_adam_cpu.cpp"
#endif
