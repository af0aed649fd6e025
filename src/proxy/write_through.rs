//! Writes through a read-side wrapper, for every stream wrapper of the proxy.
//!
//! [`super::readahead::ReadAhead`], the bridge's byte counter and the failure path's replay
//! change only how bytes are *read*; every write goes to the stream they wrap unchanged. One
//! macro writes that pass-through once, with vectored writes forwarded too: a wrapper that
//! answered `is_write_vectored() == false` made hyper flatten each response into one buffer
//! before writing it, and one without `poll_write_vectored` sent only the first slice per call.

/// Implements `AsyncWrite` for `$wrapper<$param>` by passing every call to its field `$field`.
macro_rules! write_through {
    ($wrapper:ident<$param:ident>, $field:ident) => {
        impl<$param: tokio::io::AsyncWrite + Unpin> tokio::io::AsyncWrite for $wrapper<$param> {
            fn poll_write(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                buf: &[u8],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.$field).poll_write(cx, buf)
            }

            fn poll_write_vectored(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
                bufs: &[std::io::IoSlice<'_>],
            ) -> std::task::Poll<std::io::Result<usize>> {
                std::pin::Pin::new(&mut self.$field).poll_write_vectored(cx, bufs)
            }

            fn is_write_vectored(&self) -> bool {
                self.$field.is_write_vectored()
            }

            fn poll_flush(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.$field).poll_flush(cx)
            }

            fn poll_shutdown(
                mut self: std::pin::Pin<&mut Self>,
                cx: &mut std::task::Context<'_>,
            ) -> std::task::Poll<std::io::Result<()>> {
                std::pin::Pin::new(&mut self.$field).poll_shutdown(cx)
            }
        }
    };
}

pub(crate) use write_through;
