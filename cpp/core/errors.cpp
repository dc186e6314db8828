// Names of the error kinds (messages are built where the error is raised).
#include "exl2/errors.h"

namespace exl2 {

const char* error_kind_name(ErrorKind kind) {
  switch (kind) {
    case ErrorKind::InvalidArgument: return "InvalidArgumentError";
    case ErrorKind::ModelFormat: return "ModelFormatError";
    case ErrorKind::Unsupported: return "UnsupportedError";
    case ErrorKind::Cuda: return "CudaError";
    case ErrorKind::OutOfMemory: return "OutOfMemoryError";
    case ErrorKind::Io: return "ModelFileError";
    case ErrorKind::Internal: return "InternalError";
  }
  return "Error";
}

}  // namespace exl2
