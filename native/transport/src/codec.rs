//! prost's codec, but a message that does not parse is INVALID_ARGUMENT (the caller's fault, as
//! the Python servers answer it: `trillium/wire/rpc.py`'s `_RefuseMalformed`), not prost's INTERNAL.

use std::marker::PhantomData;

use prost::Message;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder};
use tonic::Status;
use tonic_prost::ProstEncoder;

/// The codec the generated services use (build.rs's `codec_path`).
#[derive(Debug, Clone)]
pub struct LenientCodec<T, U> {
    _pd: PhantomData<(T, U)>,
}

impl<T, U> Default for LenientCodec<T, U> {
    fn default() -> Self {
        Self { _pd: PhantomData }
    }
}

impl<T, U> Codec for LenientCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = RefusingDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstEncoder::default()
    }

    fn decoder(&mut self) -> Self::Decoder {
        RefusingDecoder { _pd: PhantomData }
    }
}

/// Decodes `U`, refusing bytes that are no `U` as INVALID_ARGUMENT.
#[derive(Debug, Clone)]
pub struct RefusingDecoder<U> {
    _pd: PhantomData<U>,
}

impl<U: Message + Default> Decoder for RefusingDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        U::decode(buf).map(Some).map_err(|e| Status::invalid_argument(format!("the request does not parse: {e}")))
    }

    fn buffer_settings(&self) -> BufferSettings {
        BufferSettings::default()
    }
}
