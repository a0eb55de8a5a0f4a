/* The GDN step's body (gdn_body.h) run on the host, every workgroup of the grid in turn
 * (kernels/simt_host.h): tests/test_gdn.py compares its o and slots with reference.py bit for bit.
 *
 *   gdn_host DIR   reads DIR/args.i32 (S T Hk Hv dk dv layer n_gdn dtype, the bits of the f32 scale, every_row),
 *                  DIR/{mixed,b,a,alog,dtb}.f32 (the model dtype's values as f32), DIR/rows.i32,
 *                  DIR/slots.f32; writes DIR/o.f32 and DIR/slots_out.f32.
 * Inputs of dtype bf16 are passed as their bf16 bits (the body reads u16 for dtype 1).
 */
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../simt_host.h"
#include "gdn_body.h"

template <class T>
static std::vector<T> load(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "rb");
  if (!f) { std::perror(path.c_str()); std::exit(2); }
  std::fseek(f, 0, SEEK_END);
  const long n = std::ftell(f) / (long)sizeof(T);
  std::fseek(f, 0, SEEK_SET);
  std::vector<T> v(n);
  if (std::fread(v.data(), sizeof(T), n, f) != (size_t)n) std::exit(2);
  std::fclose(f);
  return v;
}

template <class T>
static void save(const std::string& path, const std::vector<T>& v) {
  FILE* f = std::fopen(path.c_str(), "wb");
  if (!f) { std::perror(path.c_str()); std::exit(2); }
  std::fwrite(v.data(), sizeof(T), v.size(), f);
  std::fclose(f);
}

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: gdn_host DIR (kernels/gdn/gdn_host.cc)\n");
    return 2;
  }
  const std::string dir = argv[1];
  const auto a = load<int>(dir + "/args.i32");
  if (a.size() != 11) {
    std::fprintf(stderr, "%s/args.i32: 11 int32 expected\n", dir.c_str());
    return 2;
  }
  const int S = a[0], T = a[1], Hk = a[2], Hv = a[3], dk = a[4], dv = a[5], layer = a[6], n_gdn = a[7], dtype = a[8];
  /* the body's static limits (gdn_dispatch refuses the same shapes): past them it writes out of bounds */
  if (T < 1 || T > GD_TMAX || dk < 4 || dk % 4 || dk > GD_DMAX || Hk < 1 || Hv % Hk || layer < 0 || layer >= n_gdn ||
      (dtype != 0 && dtype != 1)) {
    std::fprintf(stderr, "%s/args.i32: a shape the kernel does not take (T 1..%d, dk a multiple of 4 up to %d)\n",
                 dir.c_str(), GD_TMAX, GD_DMAX);
    return 2;
  }
  /* the model-dtype inputs: f32 values, or for bf16 their u16 bits */
  auto input = [&](const char* name) {
    auto f = load<float>(dir + "/" + name + ".f32");
    std::vector<unsigned char> bytes;
    if (dtype == 1) {
      std::vector<unsigned short> h(f.size());
      for (size_t i = 0; i < f.size(); ++i) {
        unsigned u;
        std::memcpy(&u, &f[i], 4);
        h[i] = (unsigned short)(u >> 16);
      }
      bytes.resize(h.size() * 2);
      std::memcpy(bytes.data(), h.data(), bytes.size());
    } else {
      bytes.resize(f.size() * 4);
      std::memcpy(bytes.data(), f.data(), bytes.size());
    }
    return bytes;
  };
  auto mixed = input("mixed"), b = input("b"), aa = input("a"), alog = input("alog"), dtb = input("dtb");
  auto rows = load<int>(dir + "/rows.i32");
  auto slots = load<float>(dir + "/slots.f32");
  std::vector<unsigned char> out((size_t)S * T * Hv * dv * (dtype == 1 ? 2 : 4));
  const float eps = 1e-6f, scale = gd_f((unsigned)a[9]);  /* dk^-1/2 rounded from double, as the dispatch passes it */
  const int gx = (dv + GD_COLS - 1) / GD_COLS;
  for (int s = 0; s < S; ++s)
    for (int h = 0; h < Hv; ++h)
      for (int wc = 0; wc < gx; ++wc)
        kg_host_workgroup(GD_T, [&](int tid) {
          gd_workgroup(mixed.data(), b.data(), aa.data(), alog.data(), dtb.data(), rows.data(), slots.data(), out.data(),
                       T, Hk, Hv, dk, dv, layer, n_gdn, dtype, eps, scale, a[10], wc, h, s, tid);
        });
  std::vector<float> o((size_t)S * T * Hv * dv);
  for (size_t i = 0; i < o.size(); ++i) {
    if (dtype == 1) {
      unsigned short h;
      std::memcpy(&h, out.data() + 2 * i, 2);
      const unsigned u = (unsigned)h << 16;
      std::memcpy(&o[i], &u, 4);
    } else {
      std::memcpy(&o[i], out.data() + 4 * i, 4);
    }
  }
  save(dir + "/o.f32", o);
  save(dir + "/slots_out.f32", slots);
  return 0;
}
