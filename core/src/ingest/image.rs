//! Image tokens: what an image in a prompt costs a vision-language model.
//!
//! A vision-language model turns each image into tokens of the prompt: prefilled, and held in
//! the KV cache, like text. How many depends on the model and the image's size. Qwen2-VL and
//! Qwen2.5-VL resize an image to multiples of 28 pixels and spend a token on each 28 x 28
//! square (a 1024 x 768 image: about 1,000 tokens, at most 16,384); InternVL spends 256 on each
//! 448-pixel tile, the same density; LLaVA-1.5 576 on any image; Gemma 3 256. The filter cannot
//! know the model's rule, so it counts an image at one token per `pixels_per_token` pixels of
//! the image as sent (784 by default, the 28 x 28 of the most served open families), between 1
//! and [`MAX_IMAGE_TOKENS`]; and an image whose size the body does not tell (a link rather
//! than the image itself) at `tokens` (1,024 by default). Both are configurable (`images` in
//! the configuration), for a model with another rule; `pixels_per_token: 0` counts every image
//! at `tokens`.
//!
//! Off by default (`images.enabled`): measured through Envoy against the build that counted
//! images as nothing, counting them won nowhere. With one image a request, Azure at 0.5x was
//! even; ShareGPT at 0.75x had its p99 first token 2.1x later in two runs (the VRAM guard,
//! seeing the prompts' real size, held nearly twice as many requests to keep the nodes under
//! the ceiling) for no fewer overflows; with three images, ShareGPT at 0.35x even again. The
//! engines' KV reports catch what the books miss between two polls
//! (docs/BENCHMARKS.md, "Images").

//!
//! The size is read from the image's own header, inside the base64 of a `data:` URL or of
//! Anthropic's `source.data`, without decoding more than the few bytes needed: PNG (its IHDR),
//! GIF (the logical screen), WebP (VP8, VP8L and VP8X) and JPEG (its start-of-frame segment,
//! found by stepping over the segments before it, a bounded number of them). Anything else, or
//! a header that does not parse, is an image of unknown size. An image costs its vision
//! encoder's time too; that is left out, as the filter prices prefill and KV.

/// Most tokens one image is counted at (Qwen2.5-VL's own ceiling, `max_pixels` 12,845,056 at
/// 784 pixels a token), whatever size its header claims.
pub const MAX_IMAGE_TOKENS: u64 = 16_384;

/// How images are priced (the configuration's `images`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImagePricing {
    /// Images are counted at all (off by default: see the module comment).
    pub enabled: bool,
    /// Tokens of an image whose size is not known.
    pub tokens: u64,
    /// Pixels of the image as sent that make one token; 0: every image is `tokens`.
    pub pixels_per_token: u64,
}

impl Default for ImagePricing {
    fn default() -> Self {
        ImagePricing {
            enabled: false,
            tokens: 1024,
            pixels_per_token: 784,
        }
    }
}

impl ImagePricing {
    /// The default rule, switched on.
    pub fn on() -> ImagePricing {
        ImagePricing {
            enabled: true,
            ..ImagePricing::default()
        }
    }

    /// Tokens of the image `source` stands for: a `data:` URL, another URL (`http…`), or bare
    /// base64 (Anthropic's `source.data`); `None`: an image part with no source given. None
    /// at all unless `enabled`.
    pub fn tokens(&self, source: Option<&str>) -> u64 {
        if !self.enabled {
            return 0;
        }
        let known = source
            .and_then(base64_of)
            .and_then(|b| dimensions(&Base64(b.as_bytes())));
        match known {
            Some((w, h)) if self.pixels_per_token > 0 => (u64::from(w) * u64::from(h))
                .div_ceil(self.pixels_per_token)
                .clamp(1, MAX_IMAGE_TOKENS),
            _ => self.tokens.min(MAX_IMAGE_TOKENS),
        }
    }
}

/// The base64 payload of an image source: after `;base64,` in a `data:` URL, the whole of a
/// string that is no URL; `None` for a link.
fn base64_of(source: &str) -> Option<&str> {
    if let Some(rest) = source.strip_prefix("data:") {
        return rest.split_once(";base64,").map(|(_, b)| b);
    }
    let link = source.starts_with("http://") || source.starts_with("https://");
    (!link).then_some(source)
}

/// Random access into base64 text, a decoded byte at a time (4 characters make 3 bytes).
struct Base64<'a>(&'a [u8]);

impl Base64<'_> {
    fn sextet(c: u8) -> Option<u32> {
        let v = match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' | b'-' => 62,
            b'/' | b'_' => 63,
            _ => return None,
        };
        Some(u32::from(v))
    }

    /// Decoded byte `i`, if the text holds it.
    fn byte(&self, i: usize) -> Option<u8> {
        let group = i / 3;
        let chars = self.0.get(group * 4..group * 4 + 4)?;
        let mut word = 0u32;
        // Padding decodes as zero bits: a byte that falls in it is not there.
        let have = chars.iter().take_while(|c| **c != b'=').count();
        for c in chars.iter().take(have) {
            word = (word << 6) | Self::sextet(*c)?;
        }
        word <<= 6 * (4 - have as u32);
        let k = i % 3;
        if k + 1 >= have {
            return None;
        }
        Some((word >> (16 - 8 * k as u32)) as u8)
    }

    fn be16(&self, i: usize) -> Option<u32> {
        Some(u32::from(self.byte(i)?) << 8 | u32::from(self.byte(i + 1)?))
    }

    fn le16(&self, i: usize) -> Option<u32> {
        Some(u32::from(self.byte(i)?) | u32::from(self.byte(i + 1)?) << 8)
    }

    fn le24(&self, i: usize) -> Option<u32> {
        Some(self.le16(i)? | u32::from(self.byte(i + 2)?) << 16)
    }

    fn be32(&self, i: usize) -> Option<u32> {
        Some(self.be16(i)? << 16 | self.be16(i + 2)?)
    }

    fn starts_with(&self, at: usize, bytes: &[u8]) -> bool {
        bytes
            .iter()
            .enumerate()
            .all(|(k, b)| self.byte(at + k) == Some(*b))
    }
}

/// Segments of a JPEG stepped over before its start of frame is given up on.
const MAX_JPEG_SEGMENTS: usize = 64;

/// Width and height from an image's header (PNG, GIF, WebP, JPEG); `None` when it is none of
/// these or does not parse.
fn dimensions(b: &Base64<'_>) -> Option<(u32, u32)> {
    let size = if b.starts_with(0, b"\x89PNG\r\n\x1a\n") {
        (b.be32(16)?, b.be32(20)?)
    } else if b.starts_with(0, b"GIF8") {
        (b.le16(6)?, b.le16(8)?)
    } else if b.starts_with(0, b"RIFF") && b.starts_with(8, b"WEBP") {
        webp(b)?
    } else if b.starts_with(0, b"\xff\xd8") {
        jpeg(b)?
    } else {
        return None;
    };
    (size.0 > 0 && size.1 > 0).then_some(size)
}

fn webp(b: &Base64<'_>) -> Option<(u32, u32)> {
    if b.starts_with(12, b"VP8X") {
        Some((b.le24(24)? + 1, b.le24(27)? + 1))
    } else if b.starts_with(12, b"VP8L") {
        let (b0, b1, b2, b3) = (
            u32::from(b.byte(21)?),
            u32::from(b.byte(22)?),
            u32::from(b.byte(23)?),
            u32::from(b.byte(24)?),
        );
        let w = 1 + (((b1 & 0x3f) << 8) | b0);
        let h = 1 + (((b3 & 0xf) << 10) | (b2 << 2) | ((b1 & 0xc0) >> 6));
        Some((w, h))
    } else if b.starts_with(12, b"VP8 ") {
        Some((b.le16(26)? & 0x3fff, b.le16(28)? & 0x3fff))
    } else {
        None
    }
}

fn jpeg(b: &Base64<'_>) -> Option<(u32, u32)> {
    let mut at = 2usize;
    for _ in 0..MAX_JPEG_SEGMENTS {
        if b.byte(at)? != 0xff {
            return None;
        }
        let marker = b.byte(at + 1)?;
        match marker {
            // Fill bytes before a marker.
            0xff => at += 1,
            // Markers without a length.
            0x01 | 0xd0..=0xd8 => at += 2,
            // Start of frame (not DHT, JPG or DAC): precision, height, width.
            0xc0..=0xcf if !matches!(marker, 0xc4 | 0xc8 | 0xcc) => {
                return Some((b.be16(at + 7)?, b.be16(at + 5)?));
            }
            _ => at += 2 + usize::try_from(b.be16(at + 2)?).ok()?,
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Standard base64 of `bytes` (the tests' own encoder).
    fn b64(bytes: &[u8]) -> String {
        const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
        let mut out = String::new();
        for c in bytes.chunks(3) {
            let n = c.len();
            let w = c
                .iter()
                .enumerate()
                .fold(0u32, |w, (k, b)| w | u32::from(*b) << (16 - 8 * k));
            for k in 0..4 {
                out.push(if k <= n {
                    char::from(A[((w >> (18 - 6 * k)) & 63) as usize])
                } else {
                    '='
                });
            }
        }
        out
    }

    fn png(w: u32, h: u32) -> Vec<u8> {
        let mut v = b"\x89PNG\r\n\x1a\n\0\0\0\x0dIHDR".to_vec();
        v.extend_from_slice(&w.to_be_bytes());
        v.extend_from_slice(&h.to_be_bytes());
        v.extend_from_slice(b"\x08\x02\0\0\0");
        v
    }

    fn jpeg_bytes(w: u16, h: u16) -> Vec<u8> {
        let mut v = b"\xff\xd8".to_vec();
        // An APP0 (JFIF) segment and an EXIF-sized APP1 before the frame.
        v.extend_from_slice(b"\xff\xe0\x00\x10JFIF\0\x01\x01\0\0\x01\0\x01\0\0");
        v.extend_from_slice(b"\xff\xe1\x10\x00");
        v.extend(std::iter::repeat_n(0u8, 0x1000 - 2));
        v.extend_from_slice(b"\xff\xdb\x00\x04\x00\x00");
        v.extend_from_slice(b"\xff\xc2\x00\x11\x08");
        v.extend_from_slice(&h.to_be_bytes());
        v.extend_from_slice(&w.to_be_bytes());
        v.extend_from_slice(b"\x03\x01\x22\x00");
        v
    }

    #[test]
    fn base64_decodes_any_byte_it_holds() {
        let bytes: Vec<u8> = (0..=255u8).chain(0..7).collect();
        for len in [0, 1, 2, 3, 4, 5, bytes.len()] {
            let text = b64(&bytes[..len]);
            let b = Base64(text.as_bytes());
            for i in 0..len + 3 {
                assert_eq!(b.byte(i), bytes[..len].get(i).copied(), "{len} {i}");
            }
        }
        assert_eq!(Base64(b"A!AA").byte(0), None, "not base64");
    }

    #[test]
    fn sizes_from_headers() {
        let mut gif = b"GIF89a".to_vec();
        gif.extend_from_slice(&[0x20, 0x03, 0x58, 0x02, 0, 0, 0]);
        let mut vp8x = b"RIFF\0\0\0\0WEBPVP8X\x0a\0\0\0\0\0\0\0".to_vec();
        vp8x.extend_from_slice(&[0xff, 0x03, 0x00, 0xff, 0x02, 0x00]); // 1024 x 768
        let mut vp8l = b"RIFF\0\0\0\0WEBPVP8L\0\0\0\0\x2f".to_vec();
        // 640 x 480: w-1 = 639 in 14 bits, h-1 = 479 in the next 14.
        let bits: u32 = 639 | (479 << 14);
        vp8l.extend_from_slice(&bits.to_le_bytes());
        let mut vp8 = b"RIFF\0\0\0\0WEBPVP8 \0\0\0\0\0\0\0\x9d\x01\x2a".to_vec();
        vp8.extend_from_slice(&[0x80, 0x02, 0xe0, 0x01]); // 640 x 480
        type Size = Option<(u32, u32)>;
        let cases: Vec<(Vec<u8>, Size)> = vec![
            (png(1024, 768), Some((1024, 768))),
            (gif, Some((800, 600))),
            (vp8x, Some((1024, 768))),
            (vp8l, Some((640, 480))),
            (vp8, Some((640, 480))),
            (jpeg_bytes(1920, 1080), Some((1920, 1080))),
            (png(0, 768), None),
            (b"\xff\xd8\xff\xe0\x00".to_vec(), None),
            (b"not an image at all".to_vec(), None),
        ];
        for (bytes, want) in cases {
            let text = b64(&bytes);
            assert_eq!(
                dimensions(&Base64(text.as_bytes())),
                want,
                "{:?}",
                &bytes[..8]
            );
        }
    }

    #[test]
    fn tokens_by_size_else_the_default() {
        assert_eq!(ImagePricing::default().tokens(None), 0, "off by default");
        let p = ImagePricing::on();
        let data = |bytes: &[u8]| format!("data:image/png;base64,{}", b64(bytes));
        let cases: &[(Option<String>, u64)] = &[
            // 1024 x 768 / 784 = 1003.1: 1004
            (Some(data(&png(1024, 768))), 1004),
            // Anthropic's bare base64
            (Some(b64(&png(28, 28))), 1),
            (Some(b64(&png(1, 1))), 1),
            (Some(data(&png(100_000, 100_000))), MAX_IMAGE_TOKENS),
            (Some("https://example.com/cat.png".to_string()), 1024),
            (Some("data:image/png,raw".to_string()), 1024),
            (Some(data(b"garbage bytes")), 1024),
            (None, 1024),
        ];
        for (source, want) in cases {
            assert_eq!(p.tokens(source.as_deref()), *want, "{source:?}");
        }
        let fixed = ImagePricing {
            tokens: 256,
            pixels_per_token: 0,
            ..p
        };
        assert_eq!(fixed.tokens(Some(&data(&png(1024, 768)))), 256);
        let huge = ImagePricing {
            tokens: u64::MAX,
            pixels_per_token: 1,
            ..p
        };
        assert_eq!(huge.tokens(None), MAX_IMAGE_TOKENS);
    }
}
