//! Opening GGUF files: metadata, tensor bounds checks and typed tensor reads with errors that
//! name the file and tensor, so a truncated or foreign file is refused, never a panic.

use std::fs::File;
use std::io::BufReader;
use std::path::{Path, PathBuf};

use candle_core::Device;
use candle_core::quantized::gguf_file::Content;
use candle_core::quantized::{GgmlDType, QTensor};

use crate::error::{ModelError, Result};

/// Tensor types the engine accepts (candle has CPU kernels for all of them).
const SUPPORTED: &[GgmlDType] = &[
    GgmlDType::F32,
    GgmlDType::F16,
    GgmlDType::BF16,
    GgmlDType::Q4_0,
    GgmlDType::Q4_1,
    GgmlDType::Q5_0,
    GgmlDType::Q5_1,
    GgmlDType::Q8_0,
    GgmlDType::Q2K,
    GgmlDType::Q3K,
    GgmlDType::Q4K,
    GgmlDType::Q5K,
    GgmlDType::Q6K,
];

/// An open GGUF file: parsed metadata plus a reader for tensor data.
pub struct GgufFile {
    pub path: PathBuf,
    pub content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Parses the header and checks that every tensor's data lies inside the file.
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|source| ModelError::Open {
            path: path.to_path_buf(),
            source,
        })?;
        let file_len = file
            .metadata()
            .map_err(|source| ModelError::Open {
                path: path.to_path_buf(),
                source,
            })?
            .len();
        let mut reader = BufReader::new(file);
        let content = Content::read(&mut reader).map_err(|e| ModelError::InvalidGguf {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                return Err(ModelError::InvalidGguf {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor `{name}` has {elems} elements, not a multiple of its block size {block}"
                    ),
                });
            }
            let bytes = (elems / block * info.ggml_dtype.type_size()) as u64;
            let needed = content.tensor_data_offset + info.offset + bytes;
            if needed > file_len {
                return Err(ModelError::Truncated {
                    path: path.to_path_buf(),
                    tensor: name.clone(),
                    needed,
                    file_len,
                });
            }
        }
        Ok(Self {
            path: path.to_path_buf(),
            content,
            reader,
        })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// Reads a tensor, checking its type is supported and, when given, its shape
    /// (in candle's row-major order, i.e. GGUF dims reversed).
    pub fn tensor(&mut self, name: &str, expected: Option<&[usize]>, device: &Device) -> Result<QTensor> {
        let info = self
            .content
            .tensor_infos
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        if !SUPPORTED.contains(&info.ggml_dtype) {
            return Err(ModelError::UnsupportedTensorType {
                name: name.to_string(),
                dtype: format!("{:?}", info.ggml_dtype),
            });
        }
        if let Some(expected) = expected
            && info.shape.dims() != expected
        {
            return Err(ModelError::TensorShape {
                name: name.to_string(),
                found: info.shape.dims().to_vec(),
                expected: expected.to_vec(),
            });
        }
        self.content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| ModelError::InvalidGguf {
                path: self.path.clone(),
                reason: format!("reading tensor `{name}`: {e}"),
            })
    }
}
