module @m {
  util.global private mutable @a = dense<0.0> : tensor<8xf32>
  util.global private mutable @b = dense<0.0> : tensor<8xf32>
  func.func @write_a(%x: tensor<4xf32>, %i: index) {
    %0 = util.global.load @a : tensor<8xf32>
    %1 = tensor.insert_slice %x into %0[%i] [4] [1] : tensor<4xf32> into tensor<8xf32>
    util.global.store %1, @a : tensor<8xf32>
    return
  }
  func.func @write_b(%x: tensor<4xf32>, %i: index) {
    %0 = util.global.load @b : tensor<8xf32>
    %1 = tensor.insert_slice %x into %0[%i] [4] [1] : tensor<4xf32> into tensor<8xf32>
    util.global.store %1, @b : tensor<8xf32>
    return
  }
  func.func @read_b() -> tensor<8xf32> {
    %0 = util.global.load @b : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
  func.func @read_a() -> tensor<8xf32> {
    %0 = util.global.load @a : tensor<8xf32>
    return %0 : tensor<8xf32>
  }
}
